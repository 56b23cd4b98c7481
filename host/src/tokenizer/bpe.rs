//! Byte-pair encoding by rank within one pre-tokenised piece (tiktoken semantics): repeatedly
//! merge the adjacent pair whose concatenation has the lowest rank, leftmost first on ties.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use rustc_hash::FxHashMap;

/// Ranks of byte strings (`tiktoken.model`): rank = token id.
pub struct Ranks {
    map: FxHashMap<Vec<u8>, u32>,
}

/// Pieces longer than this use the heap-based merge (O(n log n)) instead of the rescanning one.
const LONG_PIECE: usize = 64;

impl Ranks {
    pub fn new(map: FxHashMap<Vec<u8>, u32>) -> Ranks {
        Ranks { map }
    }

    pub fn get(&self, bytes: &[u8]) -> Option<u32> {
        self.map.get(bytes).copied()
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Appends the ids of `piece` to `out`.
    pub fn encode_piece(&self, piece: &[u8], out: &mut Vec<u32>) {
        if let Some(id) = self.get(piece) {
            out.push(id);
            return;
        }
        if piece.len() > LONG_PIECE {
            self.merge_heap(piece, out);
        } else {
            self.merge_scan(piece, out);
        }
    }

    fn pair_rank(&self, piece: &[u8], start: usize, end: usize) -> u32 {
        self.get(&piece[start..end]).unwrap_or(u32::MAX)
    }

    /// Short pieces: boundaries in a vector, rescanned for the minimum after each merge.
    fn merge_scan(&self, piece: &[u8], out: &mut Vec<u32>) {
        // bounds[i] = start of part i; ranks[i] = rank of part i joined with part i+1.
        let mut bounds: Vec<usize> = (0..=piece.len()).collect();
        let mut ranks: Vec<u32> = (0..piece.len().saturating_sub(1)).map(|i| self.pair_rank(piece, i, i + 2)).collect();
        while let Some((i, &r)) = ranks.iter().enumerate().min_by_key(|&(i, &r)| (r, i)) {
            if r == u32::MAX {
                break;
            }
            bounds.remove(i + 1);
            ranks.remove(i);
            if i + 2 < bounds.len() {
                ranks[i] = self.pair_rank(piece, bounds[i], bounds[i + 2]);
            }
            if i > 0 {
                ranks[i - 1] = self.pair_rank(piece, bounds[i - 1], bounds[i + 1]);
            }
        }
        for w in bounds.windows(2) {
            out.push(self.token_of(&piece[w[0]..w[1]]));
        }
    }

    /// Long pieces: a doubly linked list of parts and a min-heap of (rank, start) with lazy
    /// invalidation. Picks exactly what the scan picks: the lowest rank, then the leftmost.
    fn merge_heap(&self, piece: &[u8], out: &mut Vec<u32>) {
        let n = piece.len();
        // Parts are identified by their start byte; next[s] / prev[s] link live parts.
        let mut next: Vec<usize> = (1..=n).collect();
        let mut prev: Vec<usize> = (0..n).map(|i| i.wrapping_sub(1)).collect();
        let mut alive = vec![true; n];
        let mut heap = BinaryHeap::new();
        let rank_at = |s: usize, next: &[usize]| -> u32 {
            let m = next[s];
            if m >= n { u32::MAX } else { self.pair_rank(piece, s, next[m]) }
        };
        for s in 0..n.saturating_sub(1) {
            let r = rank_at(s, &next);
            if r != u32::MAX {
                heap.push(Reverse((r, s, next[s + 1])));
            }
        }
        while let Some(Reverse((r, s, end))) = heap.pop() {
            // Stale if either part changed since the entry was pushed.
            let m = next[s];
            if !alive[s] || m >= n || next[m] != end || rank_at(s, &next) != r {
                continue;
            }
            alive[m] = false;
            next[s] = next[m];
            if next[s] < n {
                prev[next[s]] = s;
            }
            let rs = rank_at(s, &next);
            if rs != u32::MAX {
                heap.push(Reverse((rs, s, next[next[s]])));
            }
            let p = prev[s];
            if p != usize::MAX {
                let rp = rank_at(p, &next);
                if rp != u32::MAX {
                    heap.push(Reverse((rp, p, next[next[p]])));
                }
            }
        }
        let mut s = 0;
        while s < n {
            out.push(self.token_of(&piece[s..next[s]]));
            s = next[s];
        }
    }

    /// Every single byte is a token in a tiktoken vocabulary, and every merge result is one by
    /// construction; a vocabulary without some byte makes that byte unencodable, so it maps to 0.
    fn token_of(&self, bytes: &[u8]) -> u32 {
        self.get(bytes).unwrap_or(0)
    }
}
