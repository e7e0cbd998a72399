//! The XDP program (C source built with clang to a committed object) and its
//! aya loader. Empty for now: XDP is programmed by a later issue, and the
//! daemon does not touch XDP until then. This crate is the only one allowed
//! `unsafe` (for the loader's map types); it has none yet.
