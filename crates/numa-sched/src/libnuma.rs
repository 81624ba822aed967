//! The system's libnuma (`libnuma.so.1`, Debian's `libnuma1`), behind the optional `libnuma`
//! cargo feature: `numa_alloc_onnode` and friends through a minimal FFI of our own, loaded at
//! run time with `dlopen` so that building needs no C library or headers. The default path
//! (`memory::bind_to_node`, `mbind` through libc) does the same job without it.

use std::ffi::{CStr, c_int, c_void};
use std::sync::OnceLock;

/// The functions we use, resolved once.
#[derive(Debug)]
pub struct LibNuma {
    available: unsafe extern "C" fn() -> c_int,
    max_node: unsafe extern "C" fn() -> c_int,
    node_of_cpu: unsafe extern "C" fn(c_int) -> c_int,
    alloc_onnode: unsafe extern "C" fn(usize, c_int) -> *mut c_void,
    free: unsafe extern "C" fn(*mut c_void, usize),
}

/// libnuma, if `libnuma.so.1` loads and reports NUMA as available (`numa_available() >= 0`).
pub fn get() -> Option<&'static LibNuma> {
    static LIB: OnceLock<Option<LibNuma>> = OnceLock::new();
    LIB.get_or_init(load).as_ref()
}

fn load() -> Option<LibNuma> {
    // SAFETY: dlopen with a constant NUL-terminated name; the handle is never closed, so the
    // symbols below stay valid for the life of the process.
    let handle = unsafe { libc::dlopen(c"libnuma.so.1".as_ptr(), libc::RTLD_NOW) };
    if handle.is_null() {
        return None;
    }
    let symbol = |name: &CStr| {
        // SAFETY: a live handle and a NUL-terminated name.
        let p = unsafe { libc::dlsym(handle, name.as_ptr()) };
        (!p.is_null()).then_some(p)
    };
    // SAFETY: each symbol is the libnuma function of that name, whose C signature (numa(3))
    // is the one we transmute its address to.
    let lib = unsafe {
        LibNuma {
            available: std::mem::transmute::<*mut c_void, unsafe extern "C" fn() -> c_int>(symbol(
                c"numa_available",
            )?),
            max_node: std::mem::transmute::<*mut c_void, unsafe extern "C" fn() -> c_int>(symbol(
                c"numa_max_node",
            )?),
            node_of_cpu: std::mem::transmute::<*mut c_void, unsafe extern "C" fn(c_int) -> c_int>(
                symbol(c"numa_node_of_cpu")?,
            ),
            alloc_onnode: std::mem::transmute::<
                *mut c_void,
                unsafe extern "C" fn(usize, c_int) -> *mut c_void,
            >(symbol(c"numa_alloc_onnode")?),
            free: std::mem::transmute::<*mut c_void, unsafe extern "C" fn(*mut c_void, usize)>(
                symbol(c"numa_free")?,
            ),
        }
    };
    // SAFETY: numa_available takes no arguments and must be called before the others.
    (unsafe { (lib.available)() } >= 0).then_some(lib)
}

impl LibNuma {
    /// The highest node number.
    pub fn max_node(&self) -> usize {
        // SAFETY: no arguments, no preconditions after numa_available.
        unsafe { (self.max_node)() }.max(0) as usize
    }

    /// The node of a CPU (`None` for an unknown CPU).
    pub fn node_of_cpu(&self, cpu: usize) -> Option<usize> {
        // SAFETY: any int is a valid argument; -1 means unknown.
        let node = unsafe { (self.node_of_cpu)(cpu as c_int) };
        (node >= 0).then_some(node as usize)
    }

    /// `len` bytes of memory placed on `node` (`numa_alloc_onnode`: page-aligned, zeroed on
    /// first touch, freed with the buffer).
    pub fn alloc_on_node(&'static self, len: usize, node: usize) -> Option<NodeBuffer> {
        let len = len.max(1);
        // SAFETY: plain allocation call; a null result is handled.
        let ptr = unsafe { (self.alloc_onnode)(len, node as c_int) };
        std::ptr::NonNull::new(ptr.cast::<u8>()).map(|ptr| NodeBuffer {
            ptr,
            len,
            lib: self,
        })
    }
}

/// Memory from `numa_alloc_onnode`, freed with `numa_free`.
#[derive(Debug)]
pub struct NodeBuffer {
    ptr: std::ptr::NonNull<u8>,
    len: usize,
    lib: &'static LibNuma,
}

// SAFETY: plain bytes owned by this value.
unsafe impl Send for NodeBuffer {}
// SAFETY: shared access only reads.
unsafe impl Sync for NodeBuffer {}

impl std::ops::Deref for NodeBuffer {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `len` bytes mapped by numa_alloc_onnode (anonymous memory reads as zeroes).
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl std::ops::DerefMut for NodeBuffer {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as above, and `&mut self` is the only access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for NodeBuffer {
    fn drop(&mut self) {
        // SAFETY: allocated by this library's numa_alloc_onnode with this length; freed once.
        unsafe { (self.lib.free)(self.ptr.as_ptr().cast(), self.len) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn libnuma_places_memory_where_mbind_reports_it() {
        let Some(lib) = get() else {
            eprintln!("libnuma.so.1 is not loadable here (apt install libnuma1): nothing to check");
            return;
        };
        let topology = crate::topology::Topology::detect(crate::topology::TopologyOptions {
            hyperthreads: true,
        });
        for domain in &topology.domains {
            if let (Some(node), Some(&cpu)) = (domain.node, domain.cpus.first()) {
                assert_eq!(lib.node_of_cpu(cpu), Some(node), "cpu {cpu}");
            }
        }
        assert!(
            lib.max_node()
                >= topology
                    .domains
                    .iter()
                    .filter_map(|d| d.node)
                    .max()
                    .unwrap_or(0)
        );
        let mut buf = lib.alloc_on_node(1 << 20, 0).expect("1 MiB on node 0");
        buf.fill(7);
        assert_eq!(crate::memory::node_of(&buf[0]).unwrap(), 0);
        assert_eq!(buf[(1 << 20) - 1], 7);
    }
}
