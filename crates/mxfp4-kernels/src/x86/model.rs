//! A portable model of the exact BF16 row kernel (`exact::Bf16`) and the F16/F32 row
//! kernels (`float::float_block`), for CPUs without AVX-512: each intrinsic is emulated on
//! plain arrays as Intel documents it, the loaders are transcribed line by line with the
//! kernels' own constants and address arithmetic (`lanes`), and the row kernels run through
//! the real driver (`driver::drive`, with those kernels' plans) on activations laid out by the
//! real `Activations` code. Memory reads are bounds-checked, so a load past the matrix (an
//! unsound tail) panics instead of reading a neighbour.
//!
//! What this shows without the hardware: every loader's lane `j` of `even`/`odd` holds column
//! `32b + 2j`/`32b + 2j + 1` of its row (or zero past the row's end); the activations pair
//! with the same columns; an F32 matrix of BF16 values gives the BF16 kernel's lanes, FMA chain
//! and sums bit for bit; F16 gives its F32 twin's bits; and the row kernels match the scalar
//! oracle within the usual dot-product bound; `store_sums`'s shuffles (`hsum`, `hsum16`) sum
//! in the documented tree; the MXFP4 dequant's interleave restores column order. What it
//! cannot show: that the compiler lowers the intrinsics as documented (the disassembly shows
//! `vpermt2ps`, `vpmovdw`, `vcvtph2ps` with the tables of `lanes`), nor anything about the
//! MXFP4 decode tables, `vdpbf16ps` or the VNNI tier, which this model leaves out.

#[cfg(target_arch = "x86_64")]
mod avx2;
mod intrinsics;
mod kernel;
mod tests;
