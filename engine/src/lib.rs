//! The engine crate.
