//! Buffers a thread keeps from call to call, so a kernel's working memory is allocated (and its
//! pages faulted in) once, not on every call. A call takes a buffer out and gives it back when
//! done, rather than borrowing one slot: while it waits in a parallel loop, its thread may run a
//! nested call (a stolen job) that takes another, and both are kept for the next time.

use std::cell::RefCell;

/// Buffers one thread keeps for one use; at most [`KeptBuffers::MOST`] of them.
pub struct KeptBuffers<T>(RefCell<Vec<T>>);

impl<T: Default> KeptBuffers<T> {
    /// The nesting depth kept for; deeper calls allocate and drop their own.
    pub const MOST: usize = 4;

    pub const fn new() -> KeptBuffers<T> {
        KeptBuffers(RefCell::new(Vec::new()))
    }

    /// The most recently given-back buffer, or a new empty one.
    pub fn take(&self) -> T {
        self.0.borrow_mut().pop().unwrap_or_default()
    }

    /// Keeps `buf` for a later [`take`](Self::take) on this thread.
    pub fn give(&self, buf: T) {
        let mut kept = self.0.borrow_mut();
        if kept.len() < Self::MOST {
            kept.push(buf);
        }
    }
}

impl<T: Default> Default for KeptBuffers<T> {
    fn default() -> KeptBuffers<T> {
        KeptBuffers::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A nested take gets its own buffer, and both come back (with their capacity) afterwards.
    #[test]
    fn nested_takes_get_separate_buffers_and_both_are_kept() {
        let kept: KeptBuffers<Vec<u8>> = KeptBuffers::new();
        let mut outer = kept.take();
        outer.resize(100, 1);
        let mut inner = kept.take();
        assert!(inner.is_empty(), "the nested call does not see the outer call's buffer");
        inner.resize(50, 2);
        kept.give(inner);
        kept.give(outer);
        let (a, b) = (kept.take(), kept.take());
        let mut lens = [a.len(), b.len()];
        lens.sort();
        assert_eq!(lens, [50, 100]);
        for _ in 0..KeptBuffers::<Vec<u8>>::MOST + 2 {
            kept.give(Vec::new());
        }
        assert_eq!(kept.0.borrow().len(), KeptBuffers::<Vec<u8>>::MOST);
    }
}
