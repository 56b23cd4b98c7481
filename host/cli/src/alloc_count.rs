//! A global allocator that can count allocations, so `bench forward` can print how many a
//! decode step makes. The `kimi-host` binary installs it; counting is off until a bench turns it
//! on, so `serve` pays one read of a flag no thread writes. In other binaries (the tests) nothing
//! is counted and the bench leaves the figure out.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// The system allocator, counting `alloc` and `realloc` calls while counting is on.
pub struct CountingAlloc;

static ALLOCATIONS: AtomicU64 = AtomicU64::new(0);
static COUNTING: AtomicBool = AtomicBool::new(false);

#[inline(always)]
fn count() {
    if COUNTING.load(Ordering::Relaxed) {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
    }
}

// SAFETY: every call is forwarded to the system allocator unchanged; only a counter is added.
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count();
        // SAFETY: the caller's contract is passed on.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: as above.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        count();
        // SAFETY: as above.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count();
        // SAFETY: as above.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

/// Turns counting on (for the rest of the process).
pub fn start_counting() {
    COUNTING.store(true, Ordering::Relaxed);
}

/// Allocations counted so far (0 where [`CountingAlloc`] is not installed or counting is off).
pub fn allocations() -> u64 {
    ALLOCATIONS.load(Ordering::Relaxed)
}
