//! Numbers as `k3-plan` prints them for people: whole parts grouped in thousands.

/// `x` with `decimals` decimals and its whole part grouped in thousands.
pub(super) fn fixed(x: f64, decimals: usize) -> String {
    let text = format!("{x:.decimals$}");
    let (whole, fraction) = text.split_once('.').unwrap_or((&text, ""));
    let whole = group(whole.parse().expect("a non-negative whole part"));
    match fraction {
        "" => whole,
        f => format!("{whole}.{f}"),
    }
}

/// `1048576` as `1,048,576`.
pub(super) fn group(n: usize) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}
