//! BF16 weights read in place: bf16 → f32 is a 16-bit shift, done in registers.

use super::simd::{SimdLevel, simd_level};

/// A row-major `[rows, cols]` BF16 matrix borrowed from its storage (usually a memory map).
#[derive(Clone, Copy, Debug)]
pub struct Bf16Matrix<'a> {
    pub data: &'a [u16],
    pub rows: usize,
    pub cols: usize,
}

impl<'a> Bf16Matrix<'a> {
    pub fn new(data: &'a [u16], rows: usize, cols: usize) -> Self {
        assert_eq!(data.len(), rows * cols, "Bf16Matrix: data length != rows*cols");
        Bf16Matrix { data, rows, cols }
    }

    pub fn row(&self, r: usize) -> &'a [u16] {
        &self.data[r * self.cols..(r + 1) * self.cols]
    }

    pub fn row_range(&self, start: usize, len: usize) -> Bf16Matrix<'a> {
        Bf16Matrix::new(&self.data[start * self.cols..(start + len) * self.cols], len, self.cols)
    }

    pub fn row_to_f32(&self, r: usize, out: &mut [f32]) {
        bf16_to_f32(self.row(r), out)
    }
}

/// Widens bf16 bits to f32 (exact).
#[inline]
pub fn bf16_bits_to_f32(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

/// Rounds f32 to bf16 bits, nearest-even (NaN stays NaN).
pub fn f32_to_bf16_bits(x: f32) -> u16 {
    let bits = x.to_bits();
    if x.is_nan() {
        return ((bits >> 16) | 0x40) as u16;
    }
    let round = 0x7fff + ((bits >> 16) & 1);
    (bits.wrapping_add(round) >> 16) as u16
}

/// dst[i] = f32(src[i]).
pub fn bf16_to_f32(src: &[u16], dst: &mut [f32]) {
    let n = src.len().min(dst.len());
    match simd_level() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the level was detected at run time.
        SimdLevel::Avx512 => unsafe { x86::widen_avx512(&src[..n], &mut dst[..n]) },
        #[cfg(target_arch = "x86_64")]
        SimdLevel::Avx2 => unsafe { x86::widen_avx2(&src[..n], &mut dst[..n]) },
        _ => {
            for (d, s) in dst.iter_mut().zip(src) {
                *d = bf16_bits_to_f32(*s);
            }
        }
    }
}

/// Dots four bf16 rows with one f32 vector, sharing the vector loads (the decode hot path).
pub fn dot4_bf16(rows: [&[u16]; 4], x: &[f32]) -> [f32; 4] {
    match simd_level() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the level was detected at run time; every row has x.len() values.
        SimdLevel::Avx512 => unsafe { x86::dot4_avx512(rows, x) },
        #[cfg(target_arch = "x86_64")]
        SimdLevel::Avx2 => unsafe { x86::dot4_avx2(rows, x) },
        _ => {
            let mut out = [0f32; 4];
            for (o, row) in out.iter_mut().zip(rows) {
                let mut acc = [0f32; 8];
                for (c, (w, xv)) in row.iter().zip(x).enumerate() {
                    acc[c & 7] += bf16_bits_to_f32(*w) * xv;
                }
                *o = acc.iter().sum();
            }
            out
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::bf16_bits_to_f32;
    use crate::cpu::simd::x86::hsum256;
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx512f")]
    unsafe fn load16(p: *const u16) -> __m512 {
        unsafe {
            let h = _mm256_loadu_si256(p as *const __m256i);
            _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))
        }
    }

    #[target_feature(enable = "avx2,fma")]
    unsafe fn load8(p: *const u16) -> __m256 {
        unsafe {
            let h = _mm_loadu_si128(p as *const __m128i);
            _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))
        }
    }

    #[target_feature(enable = "avx512f")]
    pub unsafe fn widen_avx512(src: &[u16], dst: &mut [f32]) {
        let n = src.len();
        let mut i = 0;
        unsafe {
            while i + 16 <= n {
                _mm512_storeu_ps(dst.as_mut_ptr().add(i), load16(src.as_ptr().add(i)));
                i += 16;
            }
        }
        for j in i..n {
            dst[j] = bf16_bits_to_f32(src[j]);
        }
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn widen_avx2(src: &[u16], dst: &mut [f32]) {
        let n = src.len();
        let mut i = 0;
        unsafe {
            while i + 8 <= n {
                _mm256_storeu_ps(dst.as_mut_ptr().add(i), load8(src.as_ptr().add(i)));
                i += 8;
            }
        }
        for j in i..n {
            dst[j] = bf16_bits_to_f32(src[j]);
        }
    }

    #[target_feature(enable = "avx512f")]
    pub unsafe fn dot4_avx512(rows: [&[u16]; 4], x: &[f32]) -> [f32; 4] {
        let n = x.len();
        let mut acc = [_mm512_setzero_ps(); 4];
        let mut i = 0;
        unsafe {
            while i + 16 <= n {
                let xv = _mm512_loadu_ps(x.as_ptr().add(i));
                for r in 0..4 {
                    acc[r] = _mm512_fmadd_ps(load16(rows[r].as_ptr().add(i)), xv, acc[r]);
                }
                i += 16;
            }
        }
        let mut out = [0f32; 4];
        for r in 0..4 {
            out[r] = _mm512_reduce_add_ps(acc[r]);
            for j in i..n {
                out[r] += bf16_bits_to_f32(rows[r][j]) * x[j];
            }
        }
        out
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot4_avx2(rows: [&[u16]; 4], x: &[f32]) -> [f32; 4] {
        let n = x.len();
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut i = 0;
        unsafe {
            while i + 8 <= n {
                let xv = _mm256_loadu_ps(x.as_ptr().add(i));
                for r in 0..4 {
                    acc[r] = _mm256_fmadd_ps(load8(rows[r].as_ptr().add(i)), xv, acc[r]);
                }
                i += 8;
            }
            let mut out = [0f32; 4];
            for r in 0..4 {
                out[r] = hsum256(acc[r]);
                for j in i..n {
                    out[r] += bf16_bits_to_f32(rows[r][j]) * x[j];
                }
            }
            out
        }
    }
}
