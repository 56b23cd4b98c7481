//! Collectives between the ranks of a tensor- or context-parallel group (as NCCL / RCCL): one
//! [`Communicator`] object per rank, every rank calling the same collectives in the same order.
//!
//! [`ThreadComm`] is the in-process implementation for CPU ranks (one thread per rank): each rank
//! writes its slot, waits at a barrier, then every rank reduces the slots **in rank order**, so
//! all ranks hold bit-identical results (as a real all-reduce gives every rank the same bits), and
//! waits again before a slot may be reused. `gpu::nccl::NcclComm` (feature `cuda`) implements the
//! same trait over NCCL / RCCL.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Barrier, Mutex, PoisonError};

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
    /// `buf ← Σ_ranks buf`, the same bits on every rank.
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
    slots: Vec<Mutex<Vec<f32>>>,
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
        let group =
            Arc::new(Group { slots: (0..size).map(|_| Mutex::new(Vec::new())).collect(), barrier: Barrier::new(size) });
        (0..size).map(|rank| ThreadComm { rank, group: group.clone(), counts: Default::default() }).collect()
    }

    fn count(&self, kind: usize, values: usize) {
        self.counts[kind].fetch_add(1, Ordering::Relaxed);
        self.counts[BYTES].fetch_add(4 * values as u64, Ordering::Relaxed);
    }

    /// Copies `data` into this rank's slot.
    fn deposit(&self, data: &[f32]) {
        let mut slot = self.group.slots[self.rank].lock().unwrap_or_else(PoisonError::into_inner);
        slot.clear();
        slot.extend_from_slice(data);
    }

    /// Runs `f` over every rank's slot in rank order.
    fn read_slots(&self, mut f: impl FnMut(usize, &[f32])) {
        for (r, slot) in self.group.slots.iter().enumerate() {
            let slot = slot.lock().unwrap_or_else(PoisonError::into_inner);
            f(r, &slot);
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
            if r == 0 {
                buf.copy_from_slice(slot);
            } else {
                buf.iter_mut().zip(slot).for_each(|(b, s)| *b += s);
            }
        });
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
        self.read_slots(|r, slot| {
            let part = &slot[mine.clone()];
            if r == 0 {
                out.copy_from_slice(part);
            } else {
                out.iter_mut().zip(part).for_each(|(o, s)| *o += s);
            }
        });
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
            let slot = self.group.slots[root].lock().unwrap_or_else(PoisonError::into_inner);
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

    #[test]
    fn all_reduce_sums_in_rank_order_with_identical_bits_everywhere() {
        for n in [1, 2, 3, 4] {
            let out = on_ranks(n, |c| {
                // Values whose sum depends on the order of additions in f32.
                let mut v: Vec<f32> =
                    (0..5).map(|i| (c.rank() as f32 + 1.0) * 1e7f32.powi(i % 2) + 0.1 * i as f32).collect();
                for _ in 0..3 {
                    c.all_reduce_sum(&mut v);
                }
                v
            });
            for r in &out {
                assert_eq!(
                    r.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                    out[0].iter().map(|x| x.to_bits()).collect::<Vec<_>>()
                );
            }
            // One round by hand: Σ_r (r + 1) · base in rank order.
            let once = on_ranks(n, |c| {
                let mut v = vec![1e7 + c.rank() as f32 * 0.3, 0.5];
                c.all_reduce_sum(&mut v);
                v
            });
            let mut want = [0f32; 2];
            for r in 0..n {
                want[0] += 1e7 + r as f32 * 0.3;
                want[1] += 0.5;
            }
            assert_eq!(once[0], want.to_vec(), "sum in rank order at n = {n}");
        }
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
