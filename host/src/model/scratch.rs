//! The forward's activation buffers: a pool of f32 vectors that a step borrows and gives back,
//! so after the first steps of a given shape a step makes no allocation of its own (no allocator
//! calls, no fresh pages to fault in and clear). Each starts on a cache line, so the kernels'
//! 64-byte loads and stores of a row never straddle two lines.

use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicUsize, Ordering};

use kimi_kernels::AlignedVec;
use parking_lot::Mutex;

/// Free vectors, handed out best-fit by capacity.
#[derive(Default)]
pub struct Scratch {
    free: Mutex<Vec<AlignedVec<f32>>>,
    /// Vectors created because none free was large enough (a steady state adds none).
    created: AtomicUsize,
}

/// A borrowed buffer; it goes back to its [`Scratch`] when dropped.
pub struct Buf<'s> {
    /// At least `len` values; the buffer is its first `len`.
    v: AlignedVec<f32>,
    len: usize,
    home: &'s Scratch,
}

impl Scratch {
    pub fn new() -> Scratch {
        Scratch::default()
    }

    /// `n` zeros.
    pub fn zeroed(&self, n: usize) -> Buf<'_> {
        let mut v = self.take(n);
        v[..n].fill(0.0);
        Buf { v, len: n, home: self }
    }

    /// `n` values for an op that writes every one of them (they hold whatever an earlier use
    /// left, so nothing is cleared first).
    pub fn for_overwrite(&self, n: usize) -> Buf<'_> {
        Buf { v: self.take(n), len: n, home: self }
    }

    /// A copy of `x`.
    pub fn copy_of(&self, x: &[f32]) -> Buf<'_> {
        let mut v = self.take(x.len());
        v[..x.len()].copy_from_slice(x);
        Buf { v, len: x.len(), home: self }
    }

    /// How many vectors the pool has had to create so far.
    pub fn created(&self) -> usize {
        self.created.load(Ordering::Relaxed)
    }

    /// A free vector of at least `n` values (best fit), or a new zeroed one.
    fn take(&self, n: usize) -> AlignedVec<f32> {
        let mut free = self.free.lock();
        let best = free.iter().enumerate().filter(|(_, v)| v.len() >= n).min_by_key(|(_, v)| v.len());
        match best.map(|(i, _)| i) {
            Some(i) => free.swap_remove(i),
            None => {
                drop(free);
                self.created.fetch_add(1, Ordering::Relaxed);
                AlignedVec::zeroed(n)
            }
        }
    }
}

impl Deref for Buf<'_> {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        &self.v[..self.len]
    }
}

impl DerefMut for Buf<'_> {
    fn deref_mut(&mut self) -> &mut [f32] {
        &mut self.v[..self.len]
    }
}

impl Drop for Buf<'_> {
    fn drop(&mut self) {
        self.home.free.lock().push(std::mem::take(&mut self.v));
    }
}
