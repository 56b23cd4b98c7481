//! KDA state slots (DESIGN §3): one slot holds every KDA layer's recurrent matrices and conv
//! windows for one sequence, as a fixed-size region of a preallocated arena; a free list hands
//! slots out and takes them back when their [`Slot`] lease drops. The engine's arena is fixed at
//! start-up (its capacity comes from the state-memory budget); tools and tests use a growable one
//! that adds chunks of slots on demand. Slots never move, so a lease's memory stays valid while the
//! arena grows.

use std::alloc::Layout;
use std::ptr::NonNull;
use std::sync::Arc;

use parking_lot::Mutex;

use super::error::ModelError;

/// Slots per chunk of a growable arena.
const CHUNK_SLOTS: usize = 8;

/// Every chunk and every slot starts on a cache line (64 bytes, 16 values): an unaligned row
/// splits each 64-byte vector load and store of the state across two lines.
const LINE_FLOATS: usize = 16;

/// A preallocated set of equal-sized f32 slots.
pub struct SlotArena {
    slot_floats: usize,
    /// Values from one slot's start to the next's: `slot_floats` rounded up to whole lines.
    stride: usize,
    /// `Some(n)`: exactly n slots, allocated at creation. `None`: grows by chunks.
    capacity: Option<usize>,
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    /// Each chunk is a leaked `Box<[f32]>` of `slots × slot_floats` values, freed in `Drop`.
    chunks: Vec<(NonNull<f32>, usize)>,
    /// Slot indices handed back, reused first.
    free: Vec<usize>,
    /// Slots ever handed out (indices below this exist).
    high: usize,
    in_use: usize,
}

// SAFETY: the chunks' memory is only reached through `Slot` leases; the free list gives each index
// to one lease at a time, so no two leases alias, and the bookkeeping sits behind a mutex.
unsafe impl Send for SlotArena {}
unsafe impl Sync for SlotArena {}

impl SlotArena {
    /// An arena of exactly `capacity` slots, allocated now (zeroed memory, committed by the OS as
    /// slots are first written); memory the machine cannot give is an error.
    pub fn fixed(slot_floats: usize, capacity: usize) -> Result<Arc<SlotArena>, ModelError> {
        let arena = SlotArena {
            slot_floats,
            stride: stride(slot_floats),
            capacity: Some(capacity),
            inner: Mutex::new(Inner::default()),
        };
        if capacity > 0 {
            let floats = capacity.checked_mul(arena.stride).ok_or(ModelError::StateAlloc { bytes: usize::MAX })?;
            arena.inner.lock().chunks.push(alloc(floats)?);
        }
        Ok(Arc::new(arena))
    }

    /// An arena that adds chunks of slots as needed (tools, tests).
    pub fn growable(slot_floats: usize) -> Arc<SlotArena> {
        Arc::new(SlotArena {
            slot_floats,
            stride: stride(slot_floats),
            capacity: None,
            inner: Mutex::new(Inner::default()),
        })
    }

    /// Values per slot.
    pub fn slot_floats(&self) -> usize {
        self.slot_floats
    }

    /// Slots leased now.
    pub fn in_use(&self) -> usize {
        self.inner.lock().in_use
    }

    /// The fixed capacity, if any.
    pub fn capacity(&self) -> Option<usize> {
        self.capacity
    }

    /// Leases a zeroed slot; a fixed arena with none free is an error, not an allocation.
    pub fn acquire(self: &Arc<SlotArena>) -> Result<Slot, ModelError> {
        let mut inner = self.inner.lock();
        let index = match inner.free.pop() {
            Some(i) => i,
            None => {
                let have = match self.capacity {
                    Some(cap) => cap,
                    None => inner.chunks.len() * CHUNK_SLOTS,
                };
                if inner.high == have {
                    match self.capacity {
                        Some(capacity) => return Err(ModelError::StateSlotsFull { capacity }),
                        None => inner.chunks.push(alloc(CHUNK_SLOTS * self.stride)?),
                    }
                }
                inner.high += 1;
                inner.high - 1
            }
        };
        inner.in_use += 1;
        let per_chunk = self.capacity.unwrap_or(CHUNK_SLOTS).max(1);
        let (base, _) = inner.chunks[index / per_chunk];
        // SAFETY: the chunk holds per_chunk × stride values, index % per_chunk < per_chunk and
        // slot_floats ≤ stride, so the slot's range lies inside it.
        let ptr = unsafe { base.add((index % per_chunk) * self.stride) };
        drop(inner);
        let mut slot = Slot { arena: self.clone(), index, ptr, len: self.slot_floats };
        slot.floats_mut().fill(0.0);
        Ok(slot)
    }

    fn release(&self, index: usize) {
        let mut inner = self.inner.lock();
        inner.free.push(index);
        inner.in_use -= 1;
    }
}

/// Values from one slot's start to the next's (at least one line).
fn stride(slot_floats: usize) -> usize {
    slot_floats.max(1).next_multiple_of(LINE_FLOATS)
}

/// The layout of a chunk of `floats` values: starting on a cache line.
fn chunk_layout(floats: usize) -> Option<Layout> {
    Layout::from_size_align(floats.checked_mul(4)?, 4 * LINE_FLOATS).ok()
}

/// Zeroed memory for `floats` values (the OS commits it as it is first written); a size the
/// machine cannot give is an error, not an abort.
fn alloc(floats: usize) -> Result<(NonNull<f32>, usize), ModelError> {
    let floats = floats.max(1);
    let too_big = || ModelError::StateAlloc { bytes: floats.saturating_mul(4) };
    let layout = chunk_layout(floats).ok_or_else(too_big)?;
    // SAFETY: the layout's size is non-zero (at least one f32).
    let ptr = unsafe { std::alloc::alloc_zeroed(layout) } as *mut f32;
    NonNull::new(ptr).map(|p| (p, floats)).ok_or_else(too_big)
}

impl Drop for SlotArena {
    fn drop(&mut self) {
        for &(ptr, len) in &self.inner.get_mut().chunks {
            // `alloc` made this layout for `len` values, so it is valid again.
            if let Some(layout) = chunk_layout(len) {
                // SAFETY: the chunk came from `alloc_zeroed` with this layout, and every lease holds
                // an Arc to the arena, so none is alive now.
                unsafe { std::alloc::dealloc(ptr.as_ptr() as *mut u8, layout) };
            }
        }
    }
}

impl std::fmt::Debug for SlotArena {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SlotArena")
            .field("slot_floats", &self.slot_floats)
            .field("capacity", &self.capacity)
            .field("in_use", &self.in_use())
            .finish()
    }
}

/// One leased slot; it goes back to its arena when dropped.
pub struct Slot {
    arena: Arc<SlotArena>,
    index: usize,
    ptr: NonNull<f32>,
    len: usize,
}

// SAFETY: a slot is the only lease of its region (see `SlotArena`); `&Slot` gives shared access
// only, `&mut Slot` exclusive access.
unsafe impl Send for Slot {}
unsafe impl Sync for Slot {}

impl Slot {
    pub fn floats(&self) -> &[f32] {
        // SAFETY: ptr..ptr+len lies inside a live chunk (the arena outlives the lease through its
        // Arc) and no other lease covers it.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    pub fn floats_mut(&mut self) -> &mut [f32] {
        // SAFETY: as in `floats`, and `&mut self` makes this the only access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }

    /// A new lease from the same arena holding a copy of this one (a fork).
    pub fn try_clone(&self) -> Result<Slot, ModelError> {
        let mut s = self.arena.acquire()?;
        s.floats_mut().copy_from_slice(self.floats());
        Ok(s)
    }

    /// A new lease from the same arena (zeroed), e.g. a speculative snapshot of this state.
    pub fn lease_sibling(&self) -> Result<Slot, ModelError> {
        self.arena.acquire()
    }

    /// This slot's index in its arena (the slot table entry a device kernel would read).
    pub fn index(&self) -> usize {
        self.index
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.arena.release(self.index);
    }
}

impl std::fmt::Debug for Slot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Slot").field("index", &self.index).field("floats", &self.len).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fixed_arenas_refuse_past_capacity_and_reuse_returned_slots() {
        let a = SlotArena::fixed(5, 2).expect("small arena");
        let mut s0 = a.acquire().expect("first");
        let s1 = a.acquire().expect("second");
        assert!(matches!(a.acquire(), Err(ModelError::StateSlotsFull { capacity: 2 })));
        s0.floats_mut().copy_from_slice(&[1.0, 2.0, 3.0, 4.0, 5.0]);
        let copy = s1.try_clone();
        assert!(copy.is_err(), "a fork needs a free slot");
        drop(s1);
        let fork = s0.try_clone().expect("a slot came back");
        assert_eq!(fork.floats(), s0.floats());
        assert_eq!(a.in_use(), 2);
        drop((s0, fork));
        assert_eq!(a.in_use(), 0);
        assert!(a.acquire().expect("reused").floats().iter().all(|&v| v == 0.0), "slots start zeroed");
    }

    #[test]
    fn growable_arenas_add_chunks_and_keep_slots_in_place() {
        let a = SlotArena::growable(3);
        let mut slots: Vec<Slot> = (0..3 * CHUNK_SLOTS + 1).map(|_| a.acquire().expect("grows")).collect();
        for (i, s) in slots.iter_mut().enumerate() {
            s.floats_mut().fill(i as f32);
        }
        for (i, s) in slots.iter().enumerate() {
            assert_eq!(s.floats(), &[i as f32; 3], "slot {i} kept its values while the arena grew");
        }
        assert_eq!(a.in_use(), 3 * CHUNK_SLOTS + 1);
    }
}
