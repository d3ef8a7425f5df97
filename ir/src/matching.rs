//! Cross-rank checks of a program: collective matching, point-to-point pairing, deadlock.
