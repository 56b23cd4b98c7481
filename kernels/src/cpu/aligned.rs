//! A buffer of plain values that starts on a cache line.
//!
//! A `Vec` of `u16` or `u8` is only as aligned as the allocator makes it (16 bytes from glibc), so
//! a 64-byte vector load or an AMX tile row read from it straddles two cache lines. Measured on a
//! Sapphire-Rapids-class core: a `tileloadd` of 16 such rows takes 16 ns against 2.5 ns aligned,
//! which made the tile products wait on their loads instead of their multiplies.

use std::fmt;
use std::marker::PhantomData;
use std::ops::{Deref, DerefMut};

use bytemuck::{Pod, Zeroable};

/// One cache line of storage.
#[derive(Clone, Copy, Zeroable, Pod)]
#[repr(C, align(64))]
struct Line([u8; 64]);

/// `len` values of `T` at the start of a run of cache lines.
pub struct AlignedVec<T> {
    lines: Vec<Line>,
    len: usize,
    _values: PhantomData<T>,
}

impl<T: Pod> AlignedVec<T> {
    /// `len` copies of `value`.
    pub fn from_elem(value: T, len: usize) -> AlignedVec<T> {
        let mut v = AlignedVec::zeroed(len);
        v.fill(value);
        v
    }

    /// `len` zero values. A large buffer is backed by 2 MB pages where Linux offers them
    /// ([`advise_huge_pages`]).
    pub fn zeroed(len: usize) -> AlignedVec<T> {
        let bytes = len.checked_mul(size_of::<T>()).expect("AlignedVec: size overflows usize");
        let n = bytes.div_ceil(64);
        let mut lines = Vec::with_capacity(n);
        // Advised before the zeros are written: the pages fault in as the advice says.
        advise_huge_pages(lines.as_ptr() as usize, n * 64);
        lines.resize(n, Line::zeroed());
        AlignedVec { lines, len, _values: PhantomData }
    }

    /// Grows to at least `len` values (new ones zero, old ones kept); never shrinks.
    pub fn reserve_len(&mut self, len: usize) {
        if len > self.len {
            let bytes = len.checked_mul(size_of::<T>()).expect("AlignedVec: size overflows usize");
            self.lines.resize(bytes.div_ceil(64), Line::zeroed());
            self.len = len;
        }
    }
}

/// Buffers from this size up ask for 2 MB pages.
const HUGE_FROM: usize = 4 << 20;

/// Asks Linux for transparent 2 MB pages under the whole 2 MB stretches of the `bytes` at `start`
/// (an allocation not yet touched; where THP is
/// in `madvise` mode, as on the race machine, nothing else gets them). A decode step streams
/// every weight once: over 4 KB pages that is a page walk per 4 KB and a hardware prefetcher
/// that stops at every page's end. Advice only: a kernel without THP ignores it, and so do we.
fn advise_huge_pages(start: usize, bytes: usize) {
    #[cfg(target_os = "linux")]
    {
        const HUGE: usize = 2 << 20;
        if bytes < HUGE_FROM {
            return;
        }
        let (first, last) = (start.next_multiple_of(HUGE), (start + bytes) / HUGE * HUGE);
        if last > first {
            // SAFETY: [first, last) lies inside the caller's allocation; MADV_HUGEPAGE only
            // changes how its pages are backed, never their contents.
            unsafe { libc::madvise(first as *mut libc::c_void, last - first, libc::MADV_HUGEPAGE) };
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (start, bytes);
}

impl<T> Default for AlignedVec<T> {
    fn default() -> AlignedVec<T> {
        AlignedVec { lines: Vec::new(), len: 0, _values: PhantomData }
    }
}

impl<T: Pod> Deref for AlignedVec<T> {
    type Target = [T];

    fn deref(&self) -> &[T] {
        // The lines' alignment (64) covers any Pod value's, and `len` values fit in them.
        bytemuck::cast_slice(&bytemuck::cast_slice::<Line, u8>(&self.lines)[..self.len * size_of::<T>()])
    }
}

impl<T: Pod> DerefMut for AlignedVec<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        let bytes = self.len * size_of::<T>();
        bytemuck::cast_slice_mut(&mut bytemuck::cast_slice_mut::<Line, u8>(&mut self.lines)[..bytes])
    }
}

impl<T> fmt::Debug for AlignedVec<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "AlignedVec<{}>[{}]", std::any::type_name::<T>(), self.len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn starts_on_a_line_and_keeps_values_when_grown() {
        let mut v = AlignedVec::<u16>::from_elem(7, 33);
        assert_eq!(v.as_ptr() as usize % 64, 0);
        assert_eq!(v.len(), 33);
        assert!(v.iter().all(|&x| x == 7));
        v[32] = 9;
        v.reserve_len(100);
        assert_eq!(v.as_ptr() as usize % 64, 0);
        assert_eq!(v.len(), 100);
        assert_eq!((v[0], v[32], v[33], v[99]), (7, 9, 0, 0));
        v.reserve_len(10);
        assert_eq!(v.len(), 100, "never shrinks");
        assert!(AlignedVec::<f32>::default().is_empty());
    }
}
