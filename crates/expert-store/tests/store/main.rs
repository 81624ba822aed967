//! Integration tests of expert-store: reading sharded checkpoints, views, the expert table,
//! and clean errors (never panics) on corrupted files.

mod budget;
mod checkpoint;
mod io_threads;
mod reshard;
mod scan;
mod warm;
mod window;
