//! Tensor-parallel sharding (spec `gpu-backend.md` §3.2, ATOM's Kimi-K3 scheme): which part of
//! every weight a rank holds. Heads (KDA and MLA) must divide evenly; every other split dimension
//! (dense and expert intermediate sizes, the vocabulary, the hidden rows of the latent MoE's
//! up-projection) is cut into contiguous ranges whose sizes differ by at most one unit — one row,
//! or one 32-column block where an MXFP4 weight is cut along its columns.

use std::ops::Range;

use super::config::TextConfig;
use super::error::ModelError;

/// This rank's place in its tensor-parallel group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shard {
    pub rank: usize,
    pub size: usize,
}

impl Shard {
    /// The whole model on one rank.
    pub const WHOLE: Shard = Shard { rank: 0, size: 1 };

    pub fn is_whole(&self) -> bool {
        self.size == 1
    }

    /// This rank's contiguous part of `n` items cut in units of `unit` (the last unit may be
    /// short): parts differ by at most one unit, the earlier ranks taking the larger ones.
    pub fn range(&self, n: usize, unit: usize) -> Range<usize> {
        split(n, unit, self.size, self.rank)
    }

    /// This rank's heads of `heads`, `[first, first + heads / size)` (even split checked by
    /// [`rank_config`]).
    pub fn heads(&self, heads: usize) -> Range<usize> {
        let per = heads / self.size;
        self.rank * per..(self.rank + 1) * per
    }
}

/// Part `rank` of `size` of `n` items in units of `unit`.
pub fn split(n: usize, unit: usize, size: usize, rank: usize) -> Range<usize> {
    let unit = unit.max(1);
    let units = n.div_ceil(unit);
    let (base, extra) = (units / size, units % size);
    let start = rank * base + rank.min(extra);
    let len = base + usize::from(rank < extra);
    (start * unit).min(n)..((start + len) * unit).min(n)
}

/// The text config as one rank of `size` sees it: KDA and MLA heads divided (so its states and
/// layers size themselves from it), everything else as stored. A head count `size` does not
/// divide is an error naming the dimension.
pub fn rank_config(c: &TextConfig, size: usize) -> Result<TextConfig, ModelError> {
    if size == 0 {
        return Err(ModelError::Parallel { msg: "--tensor-parallel must be at least 1".into() });
    }
    let check = |what: &str, n: usize| {
        if n.is_multiple_of(size) {
            Ok(n / size)
        } else {
            Err(ModelError::Parallel {
                msg: format!("--tensor-parallel {size} must divide {what} ({n}); heads are never split unevenly"),
            })
        }
    };
    let mut r = c.clone();
    r.kda.num_heads = check("linear_attn_config.num_heads (KDA heads)", c.kda.num_heads)?;
    r.mla_heads = check("num_attention_heads (MLA heads)", c.mla_heads)?;
    Ok(r)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uneven_splits_are_contiguous_and_differ_by_one_unit() {
        for (n, unit, size) in [(112, 1, 3), (10, 1, 4), (160, 32, 3), (100, 32, 3), (7, 1, 8), (512, 1, 2)] {
            let parts: Vec<Range<usize>> = (0..size).map(|r| split(n, unit, size, r)).collect();
            assert_eq!(parts[0].start, 0);
            assert_eq!(parts[size - 1].end, n, "{n}/{size} in units of {unit}");
            for w in parts.windows(2) {
                assert_eq!(w[0].end, w[1].start, "contiguous");
                assert!(w[0].start % unit == 0 && w[1].start % unit == 0, "cuts on unit boundaries");
            }
            let units: Vec<usize> = parts.iter().map(|p| p.len().div_ceil(unit)).collect();
            let (lo, hi) = (units.iter().min().copied(), units.iter().max().copied());
            assert!(hi.unwrap_or(0) - lo.unwrap_or(0) <= 1, "{units:?}");
        }
        assert_eq!(split(112, 1, 3, 0), 0..38);
        assert_eq!(split(112, 1, 3, 2), 75..112);
    }
}
