//! What the operating system tells about the machine rtune runs on: the CPU's name, the memory
//! installed, and this process's peak resident memory. Linux reads `/proc`; Windows asks Win32
//! (the registry's processor name, `GlobalMemoryStatusEx`, the peak working set); macOS asks
//! `sysctl` (`machdep.cpu.brand_string`, `hw.memsize`) and `getrusage`; elsewhere each is unknown
//! (`None`) — `doctor` says so and nothing else depends on them being known.

/// The CPU's marketing name ("AMD EPYC 7B13"), if the OS tells it.
pub fn cpu_name() -> Option<String> {
    imp::cpu_name().map(|s| s.trim().to_string()).filter(|s| !s.is_empty())
}

/// Physical memory installed, in bytes.
pub fn total_memory() -> Option<u64> {
    imp::total_memory()
}

/// This process's peak resident memory (Windows: its peak working set), in bytes.
pub fn peak_rss_bytes() -> Option<u64> {
    imp::peak_rss_bytes()
}

#[cfg(not(any(windows, target_os = "macos")))]
mod imp {
    /// A `/proc` file's first line starting with `key`, the text after it.
    fn proc_value(file: &str, key: &str) -> Option<String> {
        let s = std::fs::read_to_string(file).ok()?;
        s.lines().find_map(|l| l.strip_prefix(key)).map(|v| v.trim().to_string())
    }

    /// A `/proc` value in kB ("MemTotal:  24567890 kB"), in bytes.
    fn proc_kib(file: &str, key: &str) -> Option<u64> {
        proc_value(file, key)?.split_whitespace().next()?.parse::<u64>().ok().map(|kb| kb * 1024)
    }

    pub fn cpu_name() -> Option<String> {
        let line = proc_value("/proc/cpuinfo", "model name")?;
        line.split_once(':').map(|(_, v)| v.to_string())
    }

    pub fn total_memory() -> Option<u64> {
        proc_kib("/proc/meminfo", "MemTotal:")
    }

    pub fn peak_rss_bytes() -> Option<u64> {
        proc_kib("/proc/self/status", "VmHWM:")
    }
}

#[cfg(windows)]
mod imp {
    use windows_sys::Win32::System::ProcessStatus::{K32GetProcessMemoryInfo, PROCESS_MEMORY_COUNTERS};
    use windows_sys::Win32::System::Registry::{HKEY_LOCAL_MACHINE, RRF_RT_REG_SZ, RegGetValueW};
    use windows_sys::Win32::System::SystemInformation::{GlobalMemoryStatusEx, MEMORYSTATUSEX};
    use windows_sys::Win32::System::Threading::GetCurrentProcess;

    fn wide(s: &str) -> Vec<u16> {
        s.encode_utf16().chain([0]).collect()
    }

    pub fn cpu_name() -> Option<String> {
        let key = wide(r"HARDWARE\DESCRIPTION\System\CentralProcessor\0");
        let value = wide("ProcessorNameString");
        let mut buf = [0u16; 256];
        let mut bytes = size_of_val(&buf) as u32;
        // SAFETY: both names are NUL-terminated UTF-16; `buf` holds `bytes` bytes, and the call
        // writes at most that many (it fails with ERROR_MORE_DATA otherwise).
        let rc = unsafe {
            RegGetValueW(
                HKEY_LOCAL_MACHINE,
                key.as_ptr(),
                value.as_ptr(),
                RRF_RT_REG_SZ,
                std::ptr::null_mut(),
                buf.as_mut_ptr().cast(),
                &mut bytes,
            )
        };
        if rc != 0 {
            return None;
        }
        let units = &buf[..(bytes as usize / 2).min(buf.len())];
        let end = units.iter().position(|&u| u == 0).unwrap_or(units.len());
        Some(String::from_utf16_lossy(&units[..end]))
    }

    pub fn total_memory() -> Option<u64> {
        let mut m = MEMORYSTATUSEX { dwLength: size_of::<MEMORYSTATUSEX>() as u32, ..Default::default() };
        // SAFETY: `m` is a MEMORYSTATUSEX whose dwLength says so, as the call requires.
        (unsafe { GlobalMemoryStatusEx(&mut m) } != 0).then_some(m.ullTotalPhys)
    }

    pub fn peak_rss_bytes() -> Option<u64> {
        let size = size_of::<PROCESS_MEMORY_COUNTERS>() as u32;
        let mut c = PROCESS_MEMORY_COUNTERS { cb: size, ..Default::default() };
        // SAFETY: the pseudo-handle of this process, and a counters struct of `size` bytes.
        (unsafe { K32GetProcessMemoryInfo(GetCurrentProcess(), &mut c, size) } != 0)
            .then_some(c.PeakWorkingSetSize as u64)
    }
}

#[cfg(target_os = "macos")]
mod imp {
    use std::ffi::CStr;

    /// `sysctlbyname(name)` into `buf`; the bytes it wrote.
    fn sysctl(name: &CStr, buf: &mut [u8]) -> Option<usize> {
        let mut len = buf.len();
        // SAFETY: a NUL-terminated name, and a buffer of `len` bytes the call writes at most
        // `len` of (it fails with ENOMEM otherwise); no new value is set.
        let rc =
            unsafe { libc::sysctlbyname(name.as_ptr(), buf.as_mut_ptr().cast(), &mut len, std::ptr::null_mut(), 0) };
        (rc == 0).then_some(len.min(buf.len()))
    }

    pub fn cpu_name() -> Option<String> {
        // "Apple M2 Pro", or an Intel Mac's "Intel(R) Core(TM) i9-9880H CPU @ 2.30GHz".
        let mut buf = [0u8; 256];
        let n = sysctl(c"machdep.cpu.brand_string", &mut buf)?;
        let text = CStr::from_bytes_until_nul(&buf[..n]).ok()?;
        Some(text.to_string_lossy().into_owned())
    }

    pub fn total_memory() -> Option<u64> {
        let mut buf = [0u8; 8];
        (sysctl(c"hw.memsize", &mut buf)? == 8).then(|| u64::from_ne_bytes(buf))
    }

    pub fn peak_rss_bytes() -> Option<u64> {
        // SAFETY: `getrusage` fills the zeroed struct it is given.
        let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
        // SAFETY: RUSAGE_SELF and a valid out-pointer.
        let rc = unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut usage) };
        // macOS reports the maximum resident set in bytes (Linux in kilobytes).
        (rc == 0).then_some(usage.ru_maxrss as u64)
    }
}

#[cfg(test)]
mod tests {
    /// On the systems rtune's CI runs (Linux, and Windows under Wine) the OS tells all three;
    /// so does macOS, which CI type-checks but cannot run.
    #[cfg(any(target_os = "linux", windows, target_os = "macos"))]
    #[test]
    fn the_os_tells_the_cpu_the_memory_and_the_peak_rss() {
        let name = super::cpu_name().expect("a CPU name");
        assert!(!name.contains('\0') && name.len() > 2, "{name:?}");
        let total = super::total_memory().expect("installed memory");
        assert!(total > 256 << 20, "{total}");
        let block = vec![1u8; 64 << 20];
        std::hint::black_box(&block);
        let peak = super::peak_rss_bytes().expect("peak resident memory");
        assert!(peak >= 64 << 20 && peak < total, "{peak} of {total}");
    }
}
