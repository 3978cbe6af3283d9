//! A small seeded PRNG (SplitMix64 → xoshiro256**), so every random choice rtune makes is the
//! same on every platform and every version of every dependency.

#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Rng {
    s: [u64; 4],
}

impl Rng {
    pub fn new(seed: u64) -> Rng {
        let mut x = seed;
        let mut next = || {
            x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = x;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        };
        Rng { s: [next(), next(), next(), next()] }
    }

    /// A generator for a named purpose, independent of every other purpose's stream.
    pub fn derive(seed: u64, purpose: &str) -> Rng {
        let h = blake3::hash(format!("{seed}:{purpose}").as_bytes());
        let b = h.as_bytes();
        Rng::new(u64::from_le_bytes(b[..8].try_into().expect("8 bytes")))
    }

    pub fn next_u64(&mut self) -> u64 {
        let s = &mut self.s;
        let result = s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        result
    }

    /// Uniform in [0, 1).
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Uniform in [0, n).
    pub fn below(&mut self, n: usize) -> usize {
        ((self.next_u64() as u128 * n as u128) >> 64) as usize
    }

    /// Standard normal (Box–Muller).
    pub fn normal(&mut self) -> f64 {
        let u1 = self.next_f64().max(f64::MIN_POSITIVE);
        let u2 = self.next_f64();
        (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
    }

    pub fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            let j = self.below(i + 1);
            v.swap(i, j);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Computed independently (Python) from the xoshiro256** reference with SplitMix64 seeding.
    const GOLDEN_FIRST: u64 = 1_546_998_764_402_558_742;

    #[test]
    fn same_seed_same_stream_and_golden_values() {
        let mut a = Rng::new(42);
        let mut b = Rng::new(42);
        let xs: Vec<u64> = (0..3).map(|_| a.next_u64()).collect();
        assert_eq!(xs, (0..3).map(|_| b.next_u64()).collect::<Vec<_>>());
        // Pinned so shuffles and inits never drift silently between versions.
        assert_eq!(xs[0], GOLDEN_FIRST);
        let f = Rng::new(1).next_f64();
        assert!((0.0..1.0).contains(&f));
    }
}
