//! The driver check, on any machine: without a driver every entry point returns the typed
//! error "no CUDA driver" instead of panicking; with one, a device that is not there is named.

use kvpipe_cuda::{check_driver, device_count, driver_version, CopyEngine, CudaError, Device};

#[test]
fn a_missing_driver_or_device_is_a_typed_error_never_a_panic() {
    assert_eq!(CudaError::NoDriver.to_string(), "no CUDA driver");
    match check_driver() {
        Err(CudaError::NoDriver) => {
            assert_eq!(Device::open(0).unwrap_err(), CudaError::NoDriver);
            assert_eq!(CopyEngine::new(2).unwrap_err(), CudaError::NoDriver);
            assert_eq!(device_count(), Err(CudaError::NoDriver));
            assert_eq!(driver_version(), Err(CudaError::NoDriver));
        }
        // A driver that cannot initialise (e.g. no device visible): the same error everywhere.
        Err(other) => {
            assert_eq!(Device::open(0).unwrap_err(), other);
            assert_eq!(CopyEngine::new(2).unwrap_err(), other);
        }
        Ok(()) => {
            let count = device_count().unwrap();
            assert_eq!(
                Device::open(count).unwrap_err(),
                CudaError::NoDevice {
                    ordinal: count,
                    count
                }
            );
            assert!(driver_version().unwrap() >= 12000);
        }
    }
}
