//! An output buffer shared by parallel tasks that each write their own disjoint part of it.

/// The output's base pointer, shareable across rayon tasks. Whoever writes through [`at`]
/// must own the elements it writes (the kernels split work by rows, heads or panels).
///
/// [`at`]: DisjointOut::at
#[derive(Clone, Copy)]
pub struct DisjointOut(*mut f32);

// SAFETY: the pointer is only written through by tasks that own disjoint elements (each user
// documents its split), and the buffer outlives the parallel section that borrows it.
unsafe impl Send for DisjointOut {}
unsafe impl Sync for DisjointOut {}

impl DisjointOut {
    pub fn new(out: &mut [f32]) -> DisjointOut {
        DisjointOut(out.as_mut_ptr())
    }

    /// Element `i` (a method, so closures capture the `Send` wrapper, not its raw field).
    pub fn at(self, i: usize) -> *mut f32 {
        self.0.wrapping_add(i)
    }
}
