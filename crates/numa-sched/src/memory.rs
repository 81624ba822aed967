//! Binding memory to a NUMA node with the `mbind(2)` system call through `libc`: pure Rust,
//! no libnuma. Where the kernel has no NUMA support (or the domain is synthetic) memory is
//! placed by first touch instead: the pinned worker of the domain that writes it first.

/// `MPOL_BIND` from `<linux/mempolicy.h>`: allocate only on the nodes in the mask.
const MPOL_BIND: libc::c_int = 2;
/// `MPOL_MF_MOVE`: move pages already allocated elsewhere.
const MPOL_MF_MOVE: libc::c_uint = 1 << 1;

/// Binds the pages of `memory` to `node` (pages already touched are moved). `memory` must
/// start on a page boundary (`EINVAL` otherwise). `Err` carries the OS error (`ENOSYS`
/// without NUMA support).
pub fn bind_to_node(memory: &mut [u8], node: usize) -> std::io::Result<()> {
    let (ptr, len) = (memory.as_mut_ptr(), memory.len());
    let bits = usize::BITS as usize;
    let mut mask = vec![0usize; node / bits + 1];
    mask[node / bits] |= 1 << (node % bits);
    // SAFETY: mbind only changes the memory policy of the given range of our own mapping; the
    // mask buffer is valid for `maxnode` bits for the duration of the call.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_mbind,
            ptr,
            len,
            MPOL_BIND,
            mask.as_ptr(),
            mask.len() * bits + 1,
            MPOL_MF_MOVE,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// Binds the pages of `memory` to `node` where they lie wholly inside it (the partial pages at
/// its edges are left to first touch); false when nothing was bound.
pub fn bind_whole_pages(memory: &mut [u8], node: usize) -> bool {
    const PAGE: usize = 4096;
    let address = memory.as_ptr() as usize;
    let skip = address.next_multiple_of(PAGE) - address;
    if skip >= memory.len() {
        return false;
    }
    let pages = (memory.len() - skip) / PAGE * PAGE;
    pages > 0 && bind_to_node(&mut memory[skip..skip + pages], node).is_ok()
}

/// Binds a row-major matrix of `rows` rows in `memory` so that domain `d`'s rows
/// `[d * rows / D, (d + 1) * rows / D)` live on `nodes[d]` (`None`: left to first touch) — the
/// rows that domain's workers read. Whole pages only; returns how many ranges were bound.
pub fn bind_row_split(memory: &mut [u8], rows: usize, nodes: &[Option<usize>]) -> usize {
    if rows == 0 || nodes.iter().all(Option::is_none) {
        return 0;
    }
    let row_bytes = memory.len() / rows;
    let domains = nodes.len();
    nodes
        .iter()
        .enumerate()
        .filter(|&(d, node)| {
            let (r0, r1) = (d * rows / domains, (d + 1) * rows / domains);
            node.is_some_and(|n| bind_whole_pages(&mut memory[r0 * row_bytes..r1 * row_bytes], n))
        })
        .count()
}

/// The node the page holding `byte` is on (`get_mempolicy` with `MPOL_F_NODE | MPOL_F_ADDR`),
/// for tests and diagnostics.
pub fn node_of(byte: &u8) -> std::io::Result<usize> {
    let ptr: *const u8 = byte;
    const MPOL_F_NODE: libc::c_ulong = 1;
    const MPOL_F_ADDR: libc::c_ulong = 1 << 1;
    let mut node: libc::c_int = -1;
    // SAFETY: get_mempolicy writes one int through the pointer we pass and reads nothing else.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_get_mempolicy,
            &mut node as *mut libc::c_int,
            std::ptr::null_mut::<libc::c_ulong>(),
            0usize,
            ptr,
            MPOL_F_NODE | MPOL_F_ADDR,
        )
    };
    if rc == 0 {
        Ok(node as usize)
    } else {
        Err(std::io::Error::last_os_error())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_page_bound_to_node_0_lives_there() {
        let layout = std::alloc::Layout::from_size_align(1 << 16, 4096).unwrap();
        // SAFETY: non-zero size, power-of-two alignment; freed below.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        assert!(!ptr.is_null());
        // SAFETY: ptr points at layout.size() zeroed bytes we own until the dealloc below.
        let memory = unsafe { std::slice::from_raw_parts_mut(ptr, layout.size()) };
        match bind_to_node(memory, 0) {
            Ok(()) => {
                memory.fill(1);
                assert_eq!(node_of(&memory[0]).unwrap(), 0);
                // A node that does not exist is refused, not ignored.
                assert!(bind_to_node(memory, 1000).is_err());
                // Nor is memory that does not start on a page.
                assert!(bind_to_node(&mut memory[1..], 0).is_err());
                // Whole pages of an unaligned range, and a matrix's row halves.
                assert!(bind_whole_pages(&mut memory[1..], 0));
                assert!(!bind_whole_pages(&mut memory[1..100], 0));
                assert_eq!(bind_row_split(memory, 16, &[Some(0), Some(0)]), 2);
                assert_eq!(bind_row_split(memory, 16, &[None, None]), 0);
            }
            Err(e) => eprintln!("mbind unavailable here ({e}): first touch places memory"),
        }
        // SAFETY: allocated above with this layout.
        unsafe { std::alloc::dealloc(ptr, layout) };
    }
}
