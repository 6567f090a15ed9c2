//! What dray's benchmarks (`dray bench`) and its tests measure against: the
//! real distribution registry behind a relay that counts, and can pace, the
//! bytes it sends ([`testbed`]), and layer blobs packed as OCI archives for
//! a private containerd 1.6, the reference unpacker ([`oci_image`]). One
//! library, so the bench and every test binary share it without including
//! its files as modules. [`layer_content`] generates the layers they unpack.
//! [`cluster`] starts the tracker and agents in this process, the one
//! harness of the benches, `dray demo` and the tests.

pub mod cluster;
pub mod layer_content;
pub mod oci_image;
pub mod testbed;
