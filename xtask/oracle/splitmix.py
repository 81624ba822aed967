"""The oracle scripts' random source: splitmix64, with no dependencies, so any of them can import
it whatever packages its venv holds. Frozen vectors depend on these exact streams."""

MASK64 = (1 << 64) - 1


class SplitMix64:
    """Steele, Lea and Flood's splitmix64: tiny, and fixed forever, unlike library streams."""

    def __init__(self, seed):
        self.state = seed & MASK64

    def next_u64(self):
        self.state = (self.state + 0x9E3779B97F4A7C15) & MASK64
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
        return z ^ (z >> 31)

    def below(self, n):
        # The modulo bias is below 2^-50 for the small n used here.
        return self.next_u64() % n

    def signed_unit(self):
        """Uniform in [-1, 1) on a 2^-23 grid, so the value is exact in f32."""
        return ((self.next_u64() >> 40) / float(1 << 24)) * 2.0 - 1.0
