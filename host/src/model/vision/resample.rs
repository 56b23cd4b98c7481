//! Pillow's `Image.resize(size, BICUBIC)` for 8-bit images, bit for bit: the release processor
//! resizes with Pillow, and the vision goldens are exact only for a Pillow-identical resize.
//!
//! Pillow (`libImaging/Resample.c`) resamples separably, horizontal pass first into an 8-bit
//! intermediate of the source rows the vertical pass needs, then vertical. Each output pixel's
//! filter (Keys cubic, a = −0.5, widened by the scale on a downscale: antialiasing) is evaluated
//! in f64, normalised, and converted to 22-bit fixed point; sums are 32-bit integers rounded by
//! a half added up front and clamped to 0..=255. RGBA is resampled premultiplied by alpha
//! (`RGBA → RGBa → resize → RGBA`), with Pillow's integer premultiply and unpremultiply.

/// Fixed-point fraction bits of the 8-bit path (`32 − 8 − 2`).
const PRECISION_BITS: u32 = 22;

/// Keys' cubic convolution kernel with a = −0.5 (Pillow's `bicubic_filter`), support 2.
fn bicubic(x: f64) -> f64 {
    const A: f64 = -0.5;
    let x = x.abs();
    if x < 1.0 {
        ((A + 2.0) * x - (A + 3.0)) * x * x + 1.0
    } else if x < 2.0 {
        (((x - 5.0) * x + 8.0) * x - 4.0) * A
    } else {
        0.0
    }
}

/// Per output pixel along one axis: the first input index, and the fixed-point weights of the
/// inputs from there on (Pillow's `precompute_coeffs` + `normalize_coeffs_8bpc`).
struct Coeffs {
    first: Vec<usize>,
    weights: Vec<Vec<i32>>,
}

fn coeffs(in_size: usize, out_size: usize) -> Coeffs {
    let scale = in_size as f64 / out_size as f64;
    let filterscale = scale.max(1.0);
    let support = 2.0 * filterscale;
    let mut first = Vec::with_capacity(out_size);
    let mut weights = Vec::with_capacity(out_size);
    for xx in 0..out_size {
        let center = (xx as f64 + 0.5) * scale;
        let ss = 1.0 / filterscale;
        // C's `(int)` truncates toward zero; the clamps follow.
        let xmin = ((center - support + 0.5) as i64).max(0) as usize;
        let xmax = ((center + support + 0.5) as i64).min(in_size as i64) as usize;
        let n = xmax.saturating_sub(xmin);
        let mut k: Vec<f64> = (0..n).map(|x| bicubic((x as f64 + xmin as f64 - center + 0.5) * ss)).collect();
        let ww: f64 = k.iter().sum();
        if ww != 0.0 {
            k.iter_mut().for_each(|v| *v /= ww);
        }
        let one = (1u32 << PRECISION_BITS) as f64;
        let fixed = k.iter().map(|&v| if v < 0.0 { (-0.5 + v * one) as i32 } else { (0.5 + v * one) as i32 }).collect();
        first.push(xmin);
        weights.push(fixed);
    }
    Coeffs { first, weights }
}

fn clip8(v: i32) -> u8 {
    (v >> PRECISION_BITS).clamp(0, 255) as u8
}

/// Resizes an interleaved 8-bit image of `channels` values a pixel (3: RGB, 4: RGBA, whose
/// colour is premultiplied for the resize). Same size: a copy, as Pillow returns.
pub fn resize_bicubic(src: &[u8], width: usize, height: usize, channels: usize, new_w: usize, new_h: usize) -> Vec<u8> {
    assert_eq!(src.len(), width * height * channels, "resize_bicubic: image size");
    if (width, height) == (new_w, new_h) {
        return src.to_vec();
    }
    let premultiplied;
    let input = if channels == 4 {
        premultiplied = premultiply(src);
        &premultiplied[..]
    } else {
        src
    };
    let half = 1i32 << (PRECISION_BITS - 1);
    let (mut img, mut w, h) = (input.to_vec(), width, height);
    let cv = coeffs(height, new_h);
    // Rows of the source the vertical pass reads.
    let (y_first, y_last) = match (cv.first.first(), cv.first.last(), cv.weights.last()) {
        (Some(&f), Some(&l), Some(k)) => (f, l + k.len()),
        _ => (0, 0),
    };
    let mut y_off = 0;
    if new_w != width {
        let ch = coeffs(width, new_w);
        let rows = y_last - y_first;
        let mut out = vec![0u8; rows * new_w * channels];
        for y in 0..rows {
            let line = &img[(y + y_first) * w * channels..][..w * channels];
            for xx in 0..new_w {
                let (x0, k) = (ch.first[xx], &ch.weights[xx]);
                for c in 0..channels {
                    let mut ss = half;
                    for (x, &kv) in k.iter().enumerate() {
                        ss = ss.wrapping_add(i32::from(line[(x0 + x) * channels + c]).wrapping_mul(kv));
                    }
                    out[(y * new_w + xx) * channels + c] = clip8(ss);
                }
            }
        }
        img = out;
        w = new_w;
        y_off = y_first;
    }
    if new_h != h {
        let mut out = vec![0u8; new_h * w * channels];
        for yy in 0..new_h {
            let (y0, k) = (cv.first[yy] - y_off, &cv.weights[yy]);
            for xx in 0..w {
                for c in 0..channels {
                    let mut ss = half;
                    for (y, &kv) in k.iter().enumerate() {
                        ss = ss.wrapping_add(i32::from(img[((y0 + y) * w + xx) * channels + c]).wrapping_mul(kv));
                    }
                    out[(yy * w + xx) * channels + c] = clip8(ss);
                }
            }
        }
        img = out;
    }
    if channels == 4 { unpremultiply(&img) } else { img }
}

/// Pillow's `RGBA → RGBa`: each colour times alpha / 255 with its exact integer rounding.
fn premultiply(src: &[u8]) -> Vec<u8> {
    let mut out = src.to_vec();
    for px in out.chunks_exact_mut(4) {
        let a = u32::from(px[3]);
        for v in &mut px[..3] {
            let t = u32::from(*v) * a + 128;
            *v = (((t >> 8) + t) >> 8) as u8;
        }
    }
    out
}

/// Pillow's `RGBa → RGBA`: colour · 255 / alpha (truncated, clamped), alpha 0 and 255 as is.
fn unpremultiply(src: &[u8]) -> Vec<u8> {
    let mut out = src.to_vec();
    for px in out.chunks_exact_mut(4) {
        let a = u32::from(px[3]);
        if a != 0 && a != 255 {
            for v in &mut px[..3] {
                *v = (255 * u32::from(*v) / a).min(255) as u8;
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn filter_weights_sum_to_one_in_fixed_point() {
        for (i, o) in [(100, 37), (37, 100), (7300, 3584), (5, 1)] {
            let c = coeffs(i, o);
            for k in &c.weights {
                let s: i64 = k.iter().map(|&v| i64::from(v)).sum();
                assert!((s - (1 << PRECISION_BITS)).abs() <= k.len() as i64, "{i}->{o}: {s}");
            }
        }
    }

    #[test]
    fn a_flat_image_stays_flat() {
        let src = vec![77u8; 13 * 9 * 3];
        assert!(resize_bicubic(&src, 13, 9, 3, 5, 4).iter().all(|&v| v == 77));
    }
}
