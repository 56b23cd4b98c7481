//! The forward's activation buffers: a pool of f32 vectors that a step borrows and gives back,
//! so after the first steps of a given shape a step makes no allocation of its own (no allocator
//! calls, no fresh pages to fault in and clear).

use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicUsize, Ordering};

use parking_lot::Mutex;

/// Free vectors, handed out best-fit by capacity.
#[derive(Default)]
pub struct Scratch {
    free: Mutex<Vec<Vec<f32>>>,
    /// Vectors created because none free was large enough (a steady state adds none).
    created: AtomicUsize,
}

/// A borrowed buffer; it goes back to its [`Scratch`] when dropped.
pub struct Buf<'s> {
    v: Vec<f32>,
    home: &'s Scratch,
}

impl Scratch {
    pub fn new() -> Scratch {
        Scratch::default()
    }

    /// `n` zeros.
    pub fn zeroed(&self, n: usize) -> Buf<'_> {
        let mut v = self.take(n);
        v.clear();
        v.resize(n, 0.0);
        Buf { v, home: self }
    }

    /// `n` values for an op that writes every one of them (they hold whatever an earlier use
    /// left, so nothing is cleared first).
    pub fn for_overwrite(&self, n: usize) -> Buf<'_> {
        let mut v = self.take(n);
        if v.len() >= n {
            v.truncate(n);
        } else {
            v.resize(n, 0.0);
        }
        Buf { v, home: self }
    }

    /// A copy of `x`.
    pub fn copy_of(&self, x: &[f32]) -> Buf<'_> {
        let mut v = self.take(x.len());
        v.clear();
        v.extend_from_slice(x);
        Buf { v, home: self }
    }

    /// How many vectors the pool has had to create so far.
    pub fn created(&self) -> usize {
        self.created.load(Ordering::Relaxed)
    }

    fn take(&self, n: usize) -> Vec<f32> {
        let mut free = self.free.lock();
        let best = free.iter().enumerate().filter(|(_, v)| v.capacity() >= n).min_by_key(|(_, v)| v.capacity());
        match best.map(|(i, _)| i) {
            Some(i) => free.swap_remove(i),
            None => {
                drop(free);
                self.created.fetch_add(1, Ordering::Relaxed);
                Vec::with_capacity(n)
            }
        }
    }
}

impl Deref for Buf<'_> {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        &self.v
    }
}

impl DerefMut for Buf<'_> {
    fn deref_mut(&mut self) -> &mut [f32] {
        &mut self.v
    }
}

impl Drop for Buf<'_> {
    fn drop(&mut self) {
        self.home.free.lock().push(std::mem::take(&mut self.v));
    }
}
