//! Rotary position embedding on interleaved lane pairs (GPT-J order, DeepSeek's
//! `is_neox_style=False`), as the DSpark draft's MLA applies it to `q_pe` and `k_pe`, and from
//! per-row cos/sin tables, as the vision tower's 2-D RoPE applies it to whole heads.

/// See [`crate::Backend::rope_interleaved`].
pub fn rope_interleaved(
    x: &mut [f32],
    positions: &[usize],
    heads: usize,
    head_stride: usize,
    offset: usize,
    inv_freq: &[f32],
    magnitude: f32,
) {
    let row = heads * head_stride;
    assert_eq!(x.len(), positions.len() * row, "rope_interleaved: x is not [positions, heads, head_stride]");
    assert!(offset + 2 * inv_freq.len() <= head_stride, "rope_interleaved: the rotated lanes overrun a head");
    let mut cos_sin = vec![(0f32, 0f32); inv_freq.len()];
    for (t, &pos) in positions.iter().enumerate() {
        // The angle is formed in f32, as the references build their cos/sin tables.
        for (cs, &f) in cos_sin.iter_mut().zip(inv_freq) {
            let angle = pos as f32 * f;
            *cs = (angle.cos() * magnitude, angle.sin() * magnitude);
        }
        for h in 0..heads {
            let lanes = &mut x[t * row + h * head_stride + offset..][..2 * inv_freq.len()];
            for (pair, &(c, s)) in lanes.chunks_exact_mut(2).zip(&cos_sin) {
                let (a, b) = (pair[0], pair[1]);
                pair[0] = a * c - b * s;
                pair[1] = b * c + a * s;
            }
        }
    }
}

/// See [`crate::Backend::rope_cos_sin`].
pub fn rope_cos_sin(x: &mut [f32], cos: &[f32], sin: &[f32], heads: usize, head_stride: usize) {
    let row = heads * head_stride;
    let rows = x.len() / row.max(1);
    assert_eq!(x.len(), rows * row, "rope_cos_sin: x is not [rows, heads, head_stride]");
    let pairs = cos.len() / rows.max(1);
    assert!(
        cos.len() == rows * pairs && sin.len() == cos.len() && 2 * pairs <= head_stride,
        "rope_cos_sin: cos and sin must be [rows, pairs] with 2 · pairs ≤ head_stride"
    );
    for (t, xr) in x.chunks_exact_mut(row).enumerate() {
        let (c, s) = (&cos[t * pairs..][..pairs], &sin[t * pairs..][..pairs]);
        for head in xr.chunks_exact_mut(head_stride) {
            for ((pair, &c), &s) in head.chunks_exact_mut(2).zip(c).zip(s) {
                let (a, b) = (pair[0], pair[1]);
                pair[0] = a * c - b * s;
                pair[1] = b * c + a * s;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pairs_turn_by_their_own_frequency_and_other_lanes_stay() {
        // One token at position 2, two heads of 5 lanes, pairs at lanes 1..5.
        let mut x: Vec<f32> = (0..10).map(|v| v as f32).collect();
        let inv = [0.5f32, 0.25];
        rope_interleaved(&mut x, &[2], 2, 5, 1, &inv, 1.0);
        for h in 0..2 {
            let b = (h * 5) as f32;
            assert_eq!(x[h * 5], b, "lane 0 is not rotated");
            for (i, f) in inv.iter().enumerate() {
                let (a0, a1) = (b + 1.0 + 2.0 * i as f32, b + 2.0 + 2.0 * i as f32);
                let ang = 2.0 * f;
                let want = [a0 * ang.cos() - a1 * ang.sin(), a1 * ang.cos() + a0 * ang.sin()];
                assert!((x[h * 5 + 1 + 2 * i] - want[0]).abs() < 1e-6);
                assert!((x[h * 5 + 2 + 2 * i] - want[1]).abs() < 1e-6);
            }
        }
    }
}
