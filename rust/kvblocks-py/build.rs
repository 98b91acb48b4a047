//! Exposes pyo3's interpreter cfgs (`Py_GIL_DISABLED`, ...) to this crate's code.
fn main() {
    pyo3_build_config::use_pyo3_cfgs();
}
