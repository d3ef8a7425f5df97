//! validate (being written)
