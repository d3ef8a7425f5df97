//! Verifier of one graph (handles, order, memory events).
