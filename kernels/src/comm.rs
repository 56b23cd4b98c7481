//! Collectives between the ranks of a tensor- or context-parallel group (as NCCL / RCCL): one
//! [`Communicator`] object per rank, every rank calling the same collectives in the same order.
//!
//! [`ThreadComm`] is the in-process implementation for CPU ranks (one thread per rank): each rank
//! writes its slot, waits at a barrier, then every rank reduces the slots **pairwise in rank
//! order** (the sum of n ranks is the sum of the first 2^k, 2^k the largest power of two below n,
//! plus the sum of the rest), so all ranks hold bit-identical results (as a real all-reduce gives
//! every rank the same bits), and waits again before a slot may be reused. Pairwise is how a
//! packed product adds its column blocks (`cpu::packed`), so ranks holding whole blocks of a
//! row-parallel product reproduce one rank's sum bit for bit. `gpu::nccl::NcclComm` (feature `cuda`) implements the
//! same trait over NCCL / RCCL.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Barrier, PoisonError, RwLock};

/// Counts of one rank's collectives (for benches: calls and payload bytes a step).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CommStats {
    pub all_reduces: u64,
    pub all_gathers: u64,
    pub reduce_scatters: u64,
    pub broadcasts: u64,
    pub barriers: u64,
    /// Bytes this rank contributed to collectives (its send payload, f32).
    pub bytes_sent: u64,
}

impl CommStats {
    /// Collectives of every kind (barriers excluded).
    pub fn collectives(&self) -> u64 {
        self.all_reduces + self.all_gathers + self.reduce_scatters + self.broadcasts
    }

    /// `self + other`, per field (a rank's calls over two groups).
    pub fn plus(&self, other: &CommStats) -> CommStats {
        CommStats {
            all_reduces: self.all_reduces + other.all_reduces,
            all_gathers: self.all_gathers + other.all_gathers,
            reduce_scatters: self.reduce_scatters + other.reduce_scatters,
            broadcasts: self.broadcasts + other.broadcasts,
            barriers: self.barriers + other.barriers,
            bytes_sent: self.bytes_sent + other.bytes_sent,
        }
    }

    /// `self − earlier`, per field.
    pub fn since(&self, earlier: &CommStats) -> CommStats {
        CommStats {
            all_reduces: self.all_reduces - earlier.all_reduces,
            all_gathers: self.all_gathers - earlier.all_gathers,
            reduce_scatters: self.reduce_scatters - earlier.reduce_scatters,
            broadcasts: self.broadcasts - earlier.broadcasts,
            barriers: self.barriers - earlier.barriers,
            bytes_sent: self.bytes_sent - earlier.bytes_sent,
        }
    }
}

/// One rank's view of its group. Every rank must make the same calls in the same order with
/// the same lengths (a mismatch is a programming error: the thread implementation panics).
pub trait Communicator: Send + Sync {
    /// This rank, `0..size()`.
    fn rank(&self) -> usize;
    /// Ranks in the group.
    fn size(&self) -> usize;
    /// `buf ← Σ_ranks buf`, the same bits on every rank ([`ThreadComm`] adds pairwise in rank
    /// order; NCCL / RCCL in their own order).
    fn all_reduce_sum(&self, buf: &mut [f32]);
    /// `out ←` every rank's `local` concatenated in rank order; ranks may contribute different
    /// lengths (a vocabulary split unevenly), and `out` holds their sum.
    fn all_gather(&self, local: &[f32], out: &mut [f32]);
    /// `out ←` this rank's part of `Σ_ranks input`, where `input` is cut into `size()` parts of
    /// `counts[r]` values in rank order.
    fn reduce_scatter_sum(&self, input: &[f32], counts: &[usize], out: &mut [f32]);
    /// `buf ←` rank `root`'s `buf`.
    fn broadcast(&self, buf: &mut [f32], root: usize);
    /// Waits until every rank arrives.
    fn barrier(&self);
    /// What this rank has done so far.
    fn stats(&self) -> CommStats;
}

/// The shared side of a thread group: one slot per rank and a barrier.
struct Group {
    /// Written by their own rank only, read by every rank between the two barriers.
    slots: Vec<RwLock<Vec<f32>>>,
    barrier: Barrier,
}

/// In-process ranks (threads): see the module docs.
pub struct ThreadComm {
    rank: usize,
    group: Arc<Group>,
    counts: [AtomicU64; 6],
}

const ALL_REDUCE: usize = 0;
const ALL_GATHER: usize = 1;
const REDUCE_SCATTER: usize = 2;
const BROADCAST: usize = 3;
const BARRIER: usize = 4;
const BYTES: usize = 5;

impl ThreadComm {
    /// A group of `size` ranks: element `r` is rank `r`'s communicator, to hand to its thread.
    pub fn group(size: usize) -> Vec<ThreadComm> {
        let size = size.max(1);
        let group = Arc::new(Group {
            slots: (0..size).map(|_| RwLock::new(Vec::new())).collect(),
            barrier: Barrier::new(size),
        });
        (0..size).map(|rank| ThreadComm { rank, group: group.clone(), counts: Default::default() }).collect()
    }

    fn count(&self, kind: usize, values: usize) {
        self.counts[kind].fetch_add(1, Ordering::Relaxed);
        self.counts[BYTES].fetch_add(4 * values as u64, Ordering::Relaxed);
    }

    /// Copies `data` into this rank's slot.
    fn deposit(&self, data: &[f32]) {
        let mut slot = self.group.slots[self.rank].write().unwrap_or_else(PoisonError::into_inner);
        slot.clear();
        slot.extend_from_slice(data);
    }

    /// Runs `f` over every rank's slot in rank order.
    fn read_slots(&self, mut f: impl FnMut(usize, &[f32])) {
        for (r, slot) in self.group.slots.iter().enumerate() {
            let slot = slot.read().unwrap_or_else(PoisonError::into_inner);
            f(r, &slot);
        }
    }

    /// `out ← Σ_ranks slot[range]`, added pairwise (see the module docs).
    fn sum_slots(&self, range: std::ops::Range<usize>, out: &mut [f32]) {
        let guards: Vec<_> =
            self.group.slots.iter().map(|s| s.read().unwrap_or_else(PoisonError::into_inner)).collect();
        for (r, g) in guards.iter().enumerate() {
            assert!(g.len() >= range.end, "collective: rank {r} sent {} values, want {}", g.len(), range.end);
        }
        let parts: Vec<&[f32]> = guards.iter().map(|g| &g[range.clone()]).collect();
        let mut spare = vec![0f32; if parts.len() > 2 { out.len() } else { 0 }];
        pairwise(&parts, out, &mut spare);
    }
}

/// `out ← Σ parts`: the first 2^k parts (2^k the largest power of two below their count) summed
/// the same way, plus the rest summed the same way. `spare` is room for one more sum (needed
/// with three parts or more).
fn pairwise(parts: &[&[f32]], out: &mut [f32], spare: &mut [f32]) {
    match parts.len() {
        0 => out.fill(0.0),
        1 => out.copy_from_slice(parts[0]),
        2 => out.iter_mut().zip(parts[0].iter().zip(parts[1])).for_each(|(o, (a, b))| *o = a + b),
        n => {
            let mid = 1 << (n - 1).ilog2();
            pairwise(&parts[..mid], out, spare);
            let mut deeper = vec![0f32; if n - mid > 2 { out.len() } else { 0 }];
            pairwise(&parts[mid..], spare, &mut deeper);
            out.iter_mut().zip(spare.iter()).for_each(|(o, s)| *o += s);
        }
    }
}

impl Communicator for ThreadComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.group.slots.len()
    }

    fn all_reduce_sum(&self, buf: &mut [f32]) {
        self.count(ALL_REDUCE, buf.len());
        if self.size() == 1 {
            return;
        }
        self.deposit(buf);
        self.group.barrier.wait();
        self.read_slots(|r, slot| {
            assert_eq!(slot.len(), buf.len(), "all_reduce_sum: rank {r} sent a different length");
        });
        self.sum_slots(0..buf.len(), buf);
        self.group.barrier.wait();
    }

    fn all_gather(&self, local: &[f32], out: &mut [f32]) {
        self.count(ALL_GATHER, local.len());
        if self.size() == 1 {
            out.copy_from_slice(local);
            return;
        }
        self.deposit(local);
        self.group.barrier.wait();
        let mut at = 0;
        self.read_slots(|_, slot| {
            out[at..at + slot.len()].copy_from_slice(slot);
            at += slot.len();
        });
        assert_eq!(at, out.len(), "all_gather: the ranks' parts do not fill the output");
        self.group.barrier.wait();
    }

    fn reduce_scatter_sum(&self, input: &[f32], counts: &[usize], out: &mut [f32]) {
        self.count(REDUCE_SCATTER, input.len());
        assert_eq!(counts.len(), self.size(), "reduce_scatter_sum: one count per rank");
        assert_eq!(counts.iter().sum::<usize>(), input.len(), "reduce_scatter_sum: counts must cover the input");
        let start: usize = counts[..self.rank].iter().sum();
        let mine = start..start + counts[self.rank];
        if self.size() == 1 {
            out.copy_from_slice(&input[mine]);
            return;
        }
        self.deposit(input);
        self.group.barrier.wait();
        self.sum_slots(mine, out);
        self.group.barrier.wait();
    }

    fn broadcast(&self, buf: &mut [f32], root: usize) {
        self.count(BROADCAST, if self.rank == root { buf.len() } else { 0 });
        if self.size() == 1 {
            return;
        }
        if self.rank == root {
            self.deposit(buf);
        }
        self.group.barrier.wait();
        if self.rank != root {
            let slot = self.group.slots[root].read().unwrap_or_else(PoisonError::into_inner);
            buf.copy_from_slice(&slot);
        }
        self.group.barrier.wait();
    }

    fn barrier(&self) {
        self.counts[BARRIER].fetch_add(1, Ordering::Relaxed);
        if self.size() > 1 {
            self.group.barrier.wait();
        }
    }

    fn stats(&self) -> CommStats {
        let c = |k: usize| self.counts[k].load(Ordering::Relaxed);
        CommStats {
            all_reduces: c(ALL_REDUCE),
            all_gathers: c(ALL_GATHER),
            reduce_scatters: c(REDUCE_SCATTER),
            broadcasts: c(BROADCAST),
            barriers: c(BARRIER),
            bytes_sent: c(BYTES),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs `f(comm)` on `n` rank threads and returns their results in rank order.
    fn on_ranks<T: Send>(n: usize, f: impl Fn(&ThreadComm) -> T + Sync) -> Vec<T> {
        let comms = ThreadComm::group(n);
        std::thread::scope(|s| {
            let handles: Vec<_> = comms.iter().map(|c| s.spawn(|| f(c))).collect();
            handles.into_iter().map(|h| h.join().expect("rank thread")).collect()
        })
    }

    /// The pairwise sum written out: the first 2^k values (2^k the largest power of two below
    /// their count) and the rest, each summed the same way.
    fn pairwise_reference(v: &[f32]) -> f32 {
        match v.len() {
            0 => 0.0,
            1 => v[0],
            n => {
                let mid = 1 << (n - 1).ilog2();
                pairwise_reference(&v[..mid]) + pairwise_reference(&v[mid..])
            }
        }
    }

    #[test]
    fn all_reduce_sums_pairwise_with_identical_bits_everywhere() {
        // Rank r's value: large values that cancel, so the association shows in the bits.
        let value = |r: usize| [1.0f32, 1e8, -1e8, 1.0, 3e7, 0.25, -3e7][r] + r as f32 * 0.125;
        for n in 1..=7 {
            let out = on_ranks(n, |c| {
                let mut v: Vec<f32> = (0..5).map(|i| value(c.rank()) * 1.5f32.powi(i)).collect();
                c.all_reduce_sum(&mut v);
                let mut again = v.clone();
                c.all_reduce_sum(&mut again);
                let mut part = vec![0f32; 1];
                let counts: Vec<usize> = (0..n).map(|r| usize::from(r == 0)).collect();
                c.reduce_scatter_sum(&[value(c.rank())], &counts, &mut part[..counts[c.rank()]]);
                (v, again, part)
            });
            for (r, (v, again, part)) in out.iter().enumerate() {
                let bits = |x: &[f32]| x.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(v), bits(&out[0].0), "rank {r} of {n}: the same bits everywhere");
                assert_eq!(bits(again), bits(&out[0].1));
                for (i, got) in v.iter().enumerate() {
                    let terms: Vec<f32> = (0..n).map(|q| value(q) * 1.5f32.powi(i as i32)).collect();
                    let want = pairwise_reference(&terms);
                    assert_eq!(got.to_bits(), want.to_bits(), "n = {n}, value {i}: {got} vs {want}");
                }
                if r == 0 {
                    let want = pairwise_reference(&(0..n).map(value).collect::<Vec<_>>());
                    assert_eq!(part[0].to_bits(), want.to_bits(), "reduce-scatter adds pairwise too (n = {n})");
                }
            }
        }
        // The values tell the orders apart: at 4 ranks, rank order and pairwise differ.
        let seq = ((value(0) + value(1)) + value(2)) + value(3);
        assert_ne!(seq.to_bits(), pairwise_reference(&(0..4).map(value).collect::<Vec<_>>()).to_bits());
    }

    #[test]
    fn gather_scatter_and_broadcast_move_the_right_parts() {
        let out = on_ranks(3, |c| {
            let r = c.rank();
            // Uneven parts: rank r contributes r + 1 values.
            let local: Vec<f32> = (0..=r).map(|i| (10 * r + i) as f32).collect();
            let mut gathered = vec![0.0; 6];
            c.all_gather(&local, &mut gathered);
            let input: Vec<f32> = (0..6).map(|i| (i + r) as f32).collect();
            let counts = [1, 2, 3];
            let mut mine = vec![0.0; counts[r]];
            c.reduce_scatter_sum(&input, &counts, &mut mine);
            let mut b = vec![r as f32; 2];
            c.broadcast(&mut b, 2);
            c.barrier();
            (gathered, mine, b, c.stats())
        });
        for (r, (gathered, mine, b, stats)) in out.iter().enumerate() {
            assert_eq!(gathered, &[0.0, 10.0, 11.0, 20.0, 21.0, 22.0]);
            let start = [0, 1, 3][r];
            let want: Vec<f32> = (start..start + [1, 2, 3][r]).map(|i| (3 * i + 3) as f32).collect();
            assert_eq!(mine, &want, "rank {r}'s part of the sum");
            assert_eq!(b, &[2.0, 2.0]);
            assert_eq!((stats.all_gathers, stats.reduce_scatters, stats.broadcasts, stats.barriers), (1, 1, 1, 1));
            assert_eq!(stats.bytes_sent, 4 * (r as u64 + 1) + 24 + if r == 2 { 8 } else { 0 });
        }
    }
}
