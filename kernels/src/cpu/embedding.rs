//! Embedding gather: rows of a stored-format table widened to f32.

use crate::Matrix;

/// `out[t] = table[ids[t]]`; ids were checked against the vocabulary by the caller.
pub fn embedding(table: &Matrix<'_>, ids: &[u32], out: &mut [f32]) {
    let d = table.cols();
    assert_eq!(out.len(), ids.len() * d, "embedding: out has {} values, want {}×{d}", out.len(), ids.len());
    for (o, &id) in out.chunks_exact_mut(d).zip(ids) {
        table.row_to_f32(id as usize, o);
    }
}
