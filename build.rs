//! Generates the kubelet's side of the CRI image service (a client) from the
//! vendored `tests/proto/cri-api.proto`, for the tests that drive
//! containerd's CRI plugin. `protoc` comes from the vendored crate unless
//! `PROTOC` names one.
fn main() -> Result<(), Box<dyn std::error::Error>> {
    if std::env::var_os("PROTOC").is_none() {
        // SAFETY: build scripts are single-threaded at this point.
        unsafe { std::env::set_var("PROTOC", protoc_bin_vendored::protoc_bin_path()?) };
    }
    println!("cargo:rerun-if-changed=tests/proto");
    tonic_prost_build::configure()
        .build_server(false)
        .compile_protos(&["tests/proto/cri-api.proto"], &["tests/proto"])?;
    Ok(())
}
