//! Generates the gRPC server for containerd's snapshots service from the
//! vendored protos. `protoc` comes from the vendored crate unless `PROTOC`
//! names one, so a fresh machine needs no system package.
fn main() -> Result<(), Box<dyn std::error::Error>> {
    if std::env::var_os("PROTOC").is_none() {
        // SAFETY: build scripts are single-threaded at this point.
        unsafe { std::env::set_var("PROTOC", protoc_bin_vendored::protoc_bin_path()?) };
    }
    println!("cargo:rerun-if-changed=proto");
    let include = protoc_bin_vendored::include_path()?;
    tonic_prost_build::configure()
        .build_client(false)
        .compile_protos(
            &[std::path::PathBuf::from("proto/snapshots.proto")],
            &["proto".into(), include],
        )?;
    Ok(())
}
