//! Compiles the `.proto` files with protox (pure Rust: no system `protoc`),
//! generates prost/tonic code and writes the encoded descriptor set that the
//! server registers for gRPC reflection and dphctl uses for the JSON mapping.

use std::path::PathBuf;

fn main() -> anyhow::Result<()> {
    let files = ["felix/felixbackend.proto", "dphandler/v1/dataplane.proto"];
    for f in files {
        println!("cargo:rerun-if-changed=proto/{f}");
    }
    let fds = protox::compile(files, ["proto"])?;
    let out = PathBuf::from(std::env::var("OUT_DIR")?);
    std::fs::write(
        out.join("descriptor.bin"),
        prost::Message::encode_to_vec(&fds),
    )?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_fds(fds.clone())?;
    // The stubs once more, taking each ToDataplane message as its bytes
    // ([`crate::wire`]): the server checks them against the limits before
    // anything is decoded (a message of a million empty rules is 2 MB on
    // the wire and gigabytes decoded), and the Felix driver passes them on
    // undecoded. Every other type is the one above.
    let raw = out.join("raw");
    std::fs::create_dir_all(&raw)?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .out_dir(&raw)
        .extern_path(".felix.ToDataplane", "crate::wire::RawToDataplane")
        .extern_path(".felix", "crate::felix")
        .extern_path(".dphandler.v1", "crate::v1")
        .compile_fds(fds)?;
    Ok(())
}
