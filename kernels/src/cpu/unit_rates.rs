//! This machine's measured rates: how fast a core streams memory ([`read_sum`], the read
//! bandwidth roof `bench forward` divides by) and its multiply-add rates: f32 FMA (`vfmadd231ps zmm`) against AVX-512-BF16's
//! pair dot product (`vdpbf16ps zmm`). They are why BF16 and MXFP4 products run on the f32
//! registers (`packed`) where a CPU has AVX-512-BF16 but no AMX tiles, and `bench forward`
//! prints them so the choice can be checked on the machine at hand:
//!
//! - `vdpbf16ps` does 32 multiply-adds per instruction to FMA's 16, but over BF16 activations.
//!   One BF16 part per activation misses the goldens by hundreds of times their tolerance (router
//!   choices flip; see `packed_amx`), so the products need at least two parts (hi + lo, as the
//!   GPU kernels use): 16 useful multiply-adds per instruction, FMA's count.
//! - So a `vdpbf16ps` product beats the f32 one only where it issues faster than FMA. On the
//!   Xeons this project is raced on (Sapphire / Emerald Rapids) it issues at about a quarter of
//!   FMA's rate (one every two cycles against two a cycle): with two parts, a quarter of the f32
//!   path's speed. The widening it would save is a few percent of a product.

/// Multiply-adds per nanosecond of one core (the calling thread), best of three short runs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct UnitRates {
    /// `vfmadd231ps zmm`: 16 multiply-adds each.
    pub fma_macs_per_ns: f64,
    /// `vdpbf16ps zmm`: 32 multiply-adds each (over BF16 inputs); `None` without AVX-512-BF16.
    pub bf16_dot_macs_per_ns: Option<f64>,
}

/// The wrapping sum of `words`, read as fast as this core can: four independent 512-bit (or
/// 256-bit) accumulators over the widest loads it has. A read-bandwidth probe built on this
/// measures the roof; the compiler's own vectorisation of a plain fold reads about a quarter
/// slower on the race machine (22 against 29.5 GB/s on two threads), which would flatter every
/// ratio against it. Each iteration also prefetches the lines [`READ_AHEAD`] bytes on, as the
/// one-token products do: the roof gets every help the products get (it reads 2-4 % faster
/// with it on the race machine).
pub fn read_sum(words: &[u64]) -> u64 {
    #[cfg(target_arch = "x86_64")]
    {
        if is_x86_feature_detected!("avx512f") {
            // SAFETY: AVX-512F was detected.
            return unsafe { x86::read_sum_avx512(words) };
        }
        if is_x86_feature_detected!("avx2") {
            // SAFETY: AVX2 was detected.
            return unsafe { x86::read_sum_avx2(words) };
        }
    }
    words.iter().fold(0u64, |a, &b| a.wrapping_add(b))
}

/// How far ahead of its loads [`read_sum`] prefetches (the best of 1, 2 and 4 KB measured).
const READ_AHEAD: usize = 2048;

/// Independent accumulators per loop iteration: more than latency × issue width, so the loops
/// measure issue rate, not latency.
const CHAINS: u64 = 12;
/// Loop iterations per timed run (about 24 M instructions: milliseconds).
const ITERS: u64 = 2_000_000;

/// The rates on this CPU, or `None` where it lacks AVX-512.
pub fn measure() -> Option<UnitRates> {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx512f") {
        // SAFETY: AVX-512F was detected.
        let fma = best_rate(16, || unsafe { x86::fma_loop(ITERS) });
        let bf16 = is_x86_feature_detected!("avx512bf16").then(|| {
            // SAFETY: AVX-512-BF16 was detected.
            best_rate(32, || unsafe { x86::bf16_dot_loop(ITERS) })
        });
        return Some(UnitRates { fma_macs_per_ns: fma, bf16_dot_macs_per_ns: bf16 });
    }
    None
}

/// Best of three timed runs of `run`, in multiply-adds per nanosecond (`macs` per instruction).
#[cfg(target_arch = "x86_64")]
fn best_rate(macs: u64, run: impl Fn()) -> f64 {
    let mut best = 0f64;
    for _ in 0..3 {
        let t = std::time::Instant::now();
        run();
        let ns = t.elapsed().as_nanos().max(1) as f64;
        best = best.max((ITERS * CHAINS * macs) as f64 / ns);
    }
    best
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::READ_AHEAD;
    use std::arch::asm;
    use std::arch::x86_64::*;

    /// SAFETY (caller): AVX-512F available.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn read_sum_avx512(words: &[u64]) -> u64 {
        let body = words.len() / 32 * 32;
        let p = words.as_ptr();
        // SAFETY: every load reads words i..i + 32 < body ≤ words.len().
        let wide = unsafe {
            let mut s = [_mm512_setzero_si512(); 4];
            let mut i = 0;
            while i < body {
                for j in 0..4 {
                    // A prefetch never faults: past the end it is only wasted.
                    _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(i + READ_AHEAD / 8 + 8 * j).cast());
                }
                for (j, s) in s.iter_mut().enumerate() {
                    *s = _mm512_add_epi64(*s, _mm512_loadu_si512(p.add(i + 8 * j).cast()));
                }
                i += 32;
            }
            _mm512_reduce_add_epi64(_mm512_add_epi64(_mm512_add_epi64(s[0], s[1]), _mm512_add_epi64(s[2], s[3]))) as u64
        };
        words[body..].iter().fold(wide, |a, &b| a.wrapping_add(b))
    }

    /// SAFETY (caller): AVX2 available.
    #[target_feature(enable = "avx2")]
    pub unsafe fn read_sum_avx2(words: &[u64]) -> u64 {
        let body = words.len() / 16 * 16;
        let p = words.as_ptr();
        // SAFETY: every load reads words i..i + 16 < body ≤ words.len().
        let wide = unsafe {
            let mut s = [_mm256_setzero_si256(); 4];
            let mut i = 0;
            while i < body {
                for j in 0..2 {
                    // A prefetch never faults: past the end it is only wasted.
                    _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(i + READ_AHEAD / 8 + 8 * j).cast());
                }
                for (j, s) in s.iter_mut().enumerate() {
                    *s = _mm256_add_epi64(*s, _mm256_loadu_si256(p.add(i + 4 * j).cast()));
                }
                i += 16;
            }
            let t = _mm256_add_epi64(_mm256_add_epi64(s[0], s[1]), _mm256_add_epi64(s[2], s[3]));
            let mut lanes = [0u64; 4];
            _mm256_storeu_si256(lanes.as_mut_ptr().cast(), t);
            lanes.iter().fold(0u64, |a, &b| a.wrapping_add(b))
        };
        words[body..].iter().fold(wide, |a, &b| a.wrapping_add(b))
    }

    /// `$name(iters)`: `iters` × 12 independent `$insn zmmN, zmm0, zmm1` on zeros (no denormal
    /// assists), for a function whose caller has the target features `$features`.
    macro_rules! twelve_chains {
        ($(#[$doc:meta])* $name:ident, $features:literal, $insn:literal) => {
            $(#[$doc])*
            #[target_feature(enable = $features)]
            pub unsafe fn $name(iters: u64) {
                // SAFETY: registers only (each one it writes is declared clobbered); the
                // counter is at least 1, so the loop ends.
                unsafe {
                    asm!(
                        "vpxord zmm0, zmm0, zmm0",
                        "vpxord zmm1, zmm1, zmm1",
                        "2:",
                        concat!($insn, " zmm2, zmm0, zmm1"),
                        concat!($insn, " zmm3, zmm0, zmm1"),
                        concat!($insn, " zmm4, zmm0, zmm1"),
                        concat!($insn, " zmm5, zmm0, zmm1"),
                        concat!($insn, " zmm6, zmm0, zmm1"),
                        concat!($insn, " zmm7, zmm0, zmm1"),
                        concat!($insn, " zmm8, zmm0, zmm1"),
                        concat!($insn, " zmm9, zmm0, zmm1"),
                        concat!($insn, " zmm10, zmm0, zmm1"),
                        concat!($insn, " zmm11, zmm0, zmm1"),
                        concat!($insn, " zmm12, zmm0, zmm1"),
                        concat!($insn, " zmm13, zmm0, zmm1"),
                        "dec {n}",
                        "jnz 2b",
                        n = inout(reg) iters.max(1) => _,
                        out("zmm0") _, out("zmm1") _, out("zmm2") _, out("zmm3") _, out("zmm4") _,
                        out("zmm5") _, out("zmm6") _, out("zmm7") _, out("zmm8") _, out("zmm9") _,
                        out("zmm10") _, out("zmm11") _, out("zmm12") _, out("zmm13") _,
                        options(nostack, nomem),
                    );
                }
            }
        };
    }

    twelve_chains!(
        /// SAFETY (caller): AVX-512F available.
        fma_loop,
        "avx512f",
        "vfmadd231ps"
    );
    twelve_chains!(
        /// SAFETY (caller): AVX-512F and AVX-512-BF16 available.
        bf16_dot_loop,
        "avx512f,avx512bf16",
        "vdpbf16ps"
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The probe's sum is the sum, on every path and for lengths around its 32-word loop.
    #[test]
    fn read_sum_adds_every_word() {
        for n in [0usize, 1, 15, 16, 31, 32, 33, 100, 1000] {
            let words: Vec<u64> = (0..n as u64).map(|i| i.wrapping_mul(0x9e37_79b9_7f4a_7c15)).collect();
            let want = words.iter().fold(0u64, |a, &b| a.wrapping_add(b));
            assert_eq!(read_sum(&words), want, "{n} words");
            #[cfg(target_arch = "x86_64")]
            if is_x86_feature_detected!("avx2") {
                // SAFETY: AVX2 was detected.
                assert_eq!(unsafe { x86::read_sum_avx2(&words) }, want, "{n} words, AVX2");
            }
        }
    }

    /// The loops run (no illegal instruction) and report rates a core can have: positive, and
    /// below 4 GHz × two 512-bit units' worth (FMA: 128 multiply-adds a ns; BF16: 256).
    #[test]
    fn rates_are_measured_where_the_cpu_has_the_units() {
        let Some(r) = measure() else {
            eprintln!("skipped: this CPU has no AVX-512");
            return;
        };
        assert!(r.fma_macs_per_ns > 0.0 && r.fma_macs_per_ns < 128.0, "{r:?}");
        match r.bf16_dot_macs_per_ns {
            Some(b) => assert!(b > 0.0 && b < 256.0, "{r:?}"),
            None => eprintln!("no AVX-512-BF16 on this CPU: only FMA measured"),
        }
    }
}
