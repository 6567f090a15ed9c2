//! Compiles the wire schemas with prost. `protoc` comes from the vendored crate
//! unless `PROTOC` names one, so a fresh machine needs no system package.
fn main() -> Result<(), Box<dyn std::error::Error>> {
    if std::env::var_os("PROTOC").is_none() {
        // SAFETY: build scripts are single-threaded at this point.
        unsafe { std::env::set_var("PROTOC", protoc_bin_vendored::protoc_bin_path()?) };
    }
    println!("cargo:rerun-if-changed=proto/dray.proto");
    prost_build::Config::new()
        .bytes(["."])
        .compile_protos(&["proto/dray.proto"], &["proto"])?;
    Ok(())
}
