//! Discrete-event simulations of scale-out storms (10,000+ nodes) that drive the
//! tracker's real scheduling core and the agent's real chunk picker.
//!
//! Not built yet: issue "Scale-out storms" fills this crate. It exports nothing
//! until then.
