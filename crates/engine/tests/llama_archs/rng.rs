//! The random weights of llama.cpp's `test-llama-archs` models, drawn again: each tensor's
//! values are `std::normal_distribution<float>(0, σ)` over a `std::mt19937` seeded with
//! `seed ^ std::hash<std::string>(name)`, as GCC's libstdc++ (the C++ library of the build
//! that wrote the reference files) implements the three: MurmurHash2-64 with the seed
//! 0xc70f6907 for the hash, the Mersenne Twister of the standard, and Marsaglia's polar
//! method over `generate_canonical<float>` (one 32-bit draw per uniform, the pair's second
//! value kept for the next call).

/// libstdc++'s `std::hash<std::string>` on a 64-bit target.
pub fn string_hash(s: &[u8]) -> u64 {
    const MUL: u64 = (0xc6a4_a793u64 << 32) + 0x5bd1_e995;
    let shift_mix = |v: u64| v ^ (v >> 47);
    let mut hash = 0xc70f_6907u64 ^ (s.len() as u64).wrapping_mul(MUL);
    let mut chunks = s.chunks_exact(8);
    for c in &mut chunks {
        let word = u64::from_le_bytes(c.try_into().unwrap());
        hash ^= shift_mix(word.wrapping_mul(MUL)).wrapping_mul(MUL);
        hash = hash.wrapping_mul(MUL);
    }
    let rest = chunks.remainder();
    if !rest.is_empty() {
        let word = rest
            .iter()
            .rev()
            .fold(0u64, |acc, &b| (acc << 8) | b as u64);
        hash ^= word;
        hash = hash.wrapping_mul(MUL);
    }
    shift_mix(shift_mix(hash).wrapping_mul(MUL))
}

/// The 32-bit Mersenne Twister (`std::mt19937`), seeded with the low 32 bits of a `size_t`.
pub struct Mt19937 {
    state: [u32; 624],
    index: usize,
}

impl Mt19937 {
    pub fn new(seed: u64) -> Self {
        let mut state = [0u32; 624];
        state[0] = seed as u32;
        for i in 1..624 {
            let prev = state[i - 1];
            state[i] = 1_812_433_253u32
                .wrapping_mul(prev ^ (prev >> 30))
                .wrapping_add(i as u32);
        }
        Mt19937 { state, index: 624 }
    }

    fn twist(&mut self) {
        for i in 0..624 {
            let y = (self.state[i] & 0x8000_0000) | (self.state[(i + 1) % 624] & 0x7fff_ffff);
            let mut next = self.state[(i + 397) % 624] ^ (y >> 1);
            if y & 1 != 0 {
                next ^= 0x9908_b0df;
            }
            self.state[i] = next;
        }
        self.index = 0;
    }

    pub fn next_u32(&mut self) -> u32 {
        if self.index >= 624 {
            self.twist();
        }
        let mut y = self.state[self.index];
        self.index += 1;
        y ^= y >> 11;
        y ^= (y << 7) & 0x9d2c_5680;
        y ^= (y << 15) & 0xefc6_0000;
        y ^ (y >> 18)
    }

    /// `std::generate_canonical<float, 24>`: one draw over 2^32, kept below 1.
    fn canonical(&mut self) -> f32 {
        let r = self.next_u32() as f32 / 4_294_967_296.0f32;
        if r >= 1.0 {
            1.0f32 - f32::EPSILON / 2.0
        } else {
            r
        }
    }
}

/// `std::normal_distribution<float>` with mean 0.
pub struct Normal {
    stdev: f32,
    saved: Option<f32>,
}

impl Normal {
    pub fn new(stdev: f32) -> Self {
        Normal { stdev, saved: None }
    }

    pub fn sample(&mut self, g: &mut Mt19937) -> f32 {
        let v = match self.saved.take() {
            Some(v) => v,
            None => {
                let (x, y, r2) = loop {
                    let x = 2.0f32 * g.canonical() - 1.0;
                    let y = 2.0f32 * g.canonical() - 1.0;
                    let r2 = x * x + y * y;
                    if r2 <= 1.0 && r2 != 0.0 {
                        break (x, y, r2);
                    }
                };
                let mult = (-2.0f32 * r2.ln() / r2).sqrt();
                self.saved = Some(x * mult);
                y * mult
            }
        };
        // `· σ + mean` with mean 0: a −0 draw comes out +0, as libstdc++'s does.
        v * self.stdev + 0.0
    }
}

/// The `n` values of tensor `name` for the test's `seed` and `stdev`.
pub fn tensor_values(name: &str, seed: u64, stdev: f32, n: usize) -> Vec<f32> {
    let mut g = Mt19937::new(seed ^ string_hash(name.as_bytes()));
    let mut d = Normal::new(stdev);
    // As the llama.cpp test: a name holding "ssm_a" (Mamba's A, Qwen 3.5's `ssm_a` and
    // `ssm_alpha` alike) gets -|x| (a decay).
    let neg = name.contains("ssm_a");
    (0..n)
        .map(|_| {
            let x = d.sample(&mut g);
            if neg {
                -x.abs()
            } else {
                x
            }
        })
        .collect()
}

#[test]
fn mt19937_gives_the_standards_10000th_value() {
    // [rand.predef]: the 10000th consecutive invocation of a default-constructed mt19937
    // (seed 5489) produces 4123659995.
    let mut g = Mt19937::new(5489);
    let v = (0..10_000).map(|_| g.next_u32()).last().unwrap();
    assert_eq!(v, 4_123_659_995);
}

#[test]
fn the_hash_and_the_draws_are_libstdcxxs() {
    // Printed by GCC 12's libstdc++ (std::hash<std::string>, then std::mt19937 seeded with
    // 42 ^ hash("output.weight") under std::normal_distribution<float>(0, 0.1)).
    for (s, h) in [
        ("", 6_142_509_188_972_423_790u64),
        ("tok", 8_113_489_088_644_640_979),
        ("token_em", 3_694_026_852_606_371_784),
        ("blk.0.attn_q.weight", 4_068_745_212_705_744_642),
    ] {
        assert_eq!(string_hash(s.as_bytes()), h, "{s:?}");
    }
    let v: Vec<u32> = tensor_values("output.weight", 42, 0.1, 5)
        .iter()
        .map(|x| x.to_bits())
        .collect();
    assert_eq!(
        v,
        [0xbdff753a, 0x3d2af81d, 0xbde175b8, 0x3e4dbddb, 0x3e5dfb28]
    );
}
