//! Canonical text form of a graph (print and parse).
