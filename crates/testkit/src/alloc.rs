//! A global allocator for tests that counts what the current thread allocates, so a test can
//! assert that a decoder allocates at most a constant times its input.
//!
//! Opt in per test binary (the counting costs one thread-local add per allocation):
//!
//! ```text
//! #[global_allocator]
//! static A: kvrouter_testkit::CountingAlloc = kvrouter_testkit::CountingAlloc;
//!
//! let (out, bytes) = kvrouter_testkit::allocated_during(|| decode(&payload));
//! assert!(bytes <= 64 * payload.len() as u64 + 4096);
//! ```
//!
//! What is counted: the size asked of every `alloc`/`alloc_zeroed`, and of a `realloc` its
//! growth only (a `Vec` doubling from 8 to 16 bytes counts 8 more), on the calling thread.
//! Frees are not subtracted: the figure is the work done, not the peak held. Other threads
//! (the test harness's among them) do not disturb it. In a binary without the allocator
//! installed, [`allocated_during`] reports 0.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

/// [`System`], counting the bytes the current thread allocates (see the module).
pub struct CountingAlloc;

thread_local! {
    // Const-initialised and `Copy`: reading or bumping it never allocates (an allocation
    // here would recurse into the allocator) and needs no destructor.
    static ALLOCATED: Cell<u64> = const { Cell::new(0) };
}

fn count(bytes: usize) {
    // `try_with`: during thread teardown the slot may be gone; such allocations go uncounted.
    let _ = ALLOCATED.try_with(|c| c.set(c.get().wrapping_add(bytes as u64)));
}

// SAFETY: every call is forwarded unchanged to `System`; counting only touches a `Cell<u64>`.
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count(layout.size());
        System.alloc(layout)
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        count(layout.size());
        System.alloc_zeroed(layout)
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout)
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count(new_size.saturating_sub(layout.size()));
        System.realloc(ptr, layout, new_size)
    }
}

/// Bytes allocated so far on this thread (0 unless [`CountingAlloc`] is the global allocator).
pub fn allocated_bytes() -> u64 {
    ALLOCATED.with(Cell::get)
}

/// Runs `f` and returns its result with the bytes this thread allocated meanwhile (the
/// result's own allocations included; its drop comes later and is not counted).
pub fn allocated_during<R>(f: impl FnOnce() -> R) -> (R, u64) {
    let before = allocated_bytes();
    let r = f();
    (r, allocated_bytes().wrapping_sub(before))
}
