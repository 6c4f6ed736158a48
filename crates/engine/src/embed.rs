//! Embeddings: a sequence's final normed hidden states (the model's output norm, before the
//! output matrix) pooled into one vector and scaled to unit length, as llama-server's
//! `/v1/embeddings` returns them.

use quiver_gguf::GgufFile;

/// How a sequence's hidden states become one vector (llama.cpp's pooling types).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pooling {
    /// The mean of every token's state.
    Mean,
    /// The first token's state.
    Cls,
    /// The last token's state.
    Last,
}

impl Pooling {
    /// `mean`, `cls` or `last`.
    pub fn parse(s: &str) -> Option<Pooling> {
        match s {
            "mean" => Some(Pooling::Mean),
            "cls" => Some(Pooling::Cls),
            "last" => Some(Pooling::Last),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Pooling::Mean => "mean",
            Pooling::Cls => "cls",
            Pooling::Last => "last",
        }
    }

    /// The pooling the file declares (`{arch}.pooling_type`: 1 mean, 2 cls, 3 last), if any
    /// of these.
    pub fn of_file(file: &GgufFile) -> Option<Pooling> {
        match file.hparams().ok()?.u32("pooling_type").ok()?? {
            1 => Some(Pooling::Mean),
            2 => Some(Pooling::Cls),
            3 => Some(Pooling::Last),
            _ => None,
        }
    }
}

/// One sequence's pooled state as its rows arrive (in position order, possibly over several
/// steps).
#[derive(Clone, Debug)]
pub struct Pool {
    pooling: Pooling,
    sum: Vec<f64>,
    rows: usize,
}

impl Pool {
    pub fn new(pooling: Pooling) -> Pool {
        Pool {
            pooling,
            sum: Vec::new(),
            rows: 0,
        }
    }

    /// Adds the state of the token at position `pos` of a sequence of `len` tokens.
    pub fn add(&mut self, pos: usize, len: usize, row: &[f32]) {
        let take = match self.pooling {
            Pooling::Mean => true,
            Pooling::Cls => pos == 0,
            Pooling::Last => pos + 1 == len,
        };
        if !take {
            return;
        }
        if self.sum.is_empty() {
            self.sum = vec![0.0; row.len()];
        }
        for (s, &v) in self.sum.iter_mut().zip(row) {
            *s += v as f64;
        }
        self.rows += 1;
    }

    /// Starts over (the sequence is computed again from its first token).
    pub fn reset(&mut self) {
        self.sum.clear();
        self.rows = 0;
    }

    /// The pooled vector at unit Euclidean length (all zeros stay zeros).
    pub fn finish(&self) -> Vec<f32> {
        let n = self.rows.max(1) as f64;
        let v: Vec<f64> = self.sum.iter().map(|s| s / n).collect();
        let norm = v.iter().map(|x| x * x).sum::<f64>().sqrt();
        let scale = if norm > 0.0 { 1.0 / norm } else { 0.0 };
        v.iter().map(|x| (x * scale) as f32).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pooling_takes_the_rows_it_names_and_normalizes() {
        let rows = [[1.0f32, 0.0], [3.0, 4.0], [0.0, -2.0]];
        let pooled = |p| {
            let mut pool = Pool::new(p);
            for (i, r) in rows.iter().enumerate() {
                pool.add(i, rows.len(), r);
            }
            pool.finish()
        };
        // Mean (4/3, 2/3) scaled to length 1.
        let m = pooled(Pooling::Mean);
        let n = (16.0f64 / 9.0 + 4.0 / 9.0).sqrt();
        assert!(
            (m[0] as f64 - 4.0 / 3.0 / n).abs() < 1e-6
                && (m[1] as f64 - 2.0 / 3.0 / n).abs() < 1e-6
        );
        assert_eq!(pooled(Pooling::Cls), vec![1.0, 0.0]);
        assert_eq!(pooled(Pooling::Last), vec![0.0, -1.0]);
        let mut p = Pool::new(Pooling::Mean);
        p.add(0, 1, &[5.0, 0.0]);
        p.reset();
        p.add(0, 1, &[0.0, 2.0]);
        assert_eq!(p.finish(), vec![0.0, 1.0]);
        assert_eq!(Pool::new(Pooling::Mean).finish(), Vec::<f32>::new());
        assert_eq!(Pooling::parse("last"), Some(Pooling::Last));
        assert_eq!(Pooling::parse("none"), None);
    }
}
