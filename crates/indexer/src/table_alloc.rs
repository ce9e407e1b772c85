//! Where the index's hash tables get their memory.
//!
//! From the system allocator: a big table is its own mapping (see the binary's mmap
//! threshold), returned to the OS the moment a resize frees it rather than lingering in the
//! global allocator's caches. And a big table asks for transparent huge pages (where the
//! kernel's setting is `madvise`): its probes land anywhere in it, so with 4 KiB pages
//! nearly every probe also misses the TLB.

use allocator_api2::alloc::{AllocError, Allocator, Layout};
use std::alloc::System;
use std::ptr::NonNull;

/// Tables at least this big ask for huge pages (two 2 MiB pages).
const HUGE_PAGE: usize = 2 << 20;

#[derive(Clone, Copy, Debug, Default)]
pub struct TableAlloc;

// SAFETY: every call is forwarded to `System`; the advice never changes memory contents.
unsafe impl Allocator for TableAlloc {
    fn allocate(&self, layout: Layout) -> Result<NonNull<[u8]>, AllocError> {
        let block = System.allocate(layout)?;
        advise_huge_pages(block.as_ptr() as *mut u8 as usize, layout.size());
        Ok(block)
    }

    unsafe fn deallocate(&self, ptr: NonNull<u8>, layout: Layout) {
        // SAFETY: `ptr` came from `System` with this layout (see `allocate`).
        unsafe { System.deallocate(ptr, layout) }
    }
}

fn advise_huge_pages(addr: usize, bytes: usize) {
    if bytes < 2 * HUGE_PAGE {
        return;
    }
    #[cfg(target_os = "linux")]
    {
        let start = addr.next_multiple_of(HUGE_PAGE);
        let end = (addr + bytes) / HUGE_PAGE * HUGE_PAGE;
        if end > start {
            // SAFETY: advice on whole pages of an allocation we own; a failure is harmless.
            unsafe {
                libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE);
            }
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = addr;
}
