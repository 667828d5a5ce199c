//! A reference run and a variant (FP8 KV, FP8 weights, ...) fed the same tokens: the
//! reference's greedy token each step (teacher forcing), so every step compares logits over
//! the same context. The figures are what the accuracy reports print.

/// Index of the largest value (the first on ties).
pub fn argmax(xs: &[f32]) -> u32 {
    xs.iter().enumerate().fold((0, f32::NEG_INFINITY), |b, (i, &x)| if x > b.1 { (i, x) } else { b }).0 as u32
}

/// The comparison's figures over `steps` steps.
pub struct Figures {
    /// Mean |Δlogit| over every logit of every step.
    pub mean_abs: f64,
    /// Largest |Δlogit|.
    pub max_abs: f32,
    /// Steps whose greedy token agrees.
    pub agree: usize,
    /// Steps compared.
    pub steps: usize,
}

impl Figures {
    /// Prints the figures as `{tag} {name}: ...` and asserts only what must hold of any run:
    /// finite figures and greedy agreement on at least half the steps.
    pub fn report(&self, tag: &str, name: &str) {
        println!(
            "{tag} {name}: mean |Δlogit| {:.5}, max |Δlogit| {:.4}, greedy agreement {}/{} ({:.1} %)",
            self.mean_abs,
            self.max_abs,
            self.agree,
            self.steps,
            100.0 * self.agree as f64 / self.steps as f64
        );
        assert!(self.mean_abs.is_finite() && self.max_abs.is_finite());
        assert!(self.agree * 2 >= self.steps, "{name}: greedy agreement {}/{}", self.agree, self.steps);
    }
}

/// Feeds `prompt` to both, then `steps - 1` of the reference's greedy tokens; each `feed`
/// returns the logits of the last position it was given.
pub fn compare(
    prompt: &[u32],
    steps: usize,
    mut reference: impl FnMut(&[u32]) -> Vec<f32>,
    mut variant: impl FnMut(&[u32]) -> Vec<f32>,
) -> Figures {
    let (mut a, mut b) = (reference(prompt), variant(prompt));
    let (mut sum, mut n, mut max_abs, mut agree) = (0.0f64, 0usize, 0.0f32, 0usize);
    for step in 0..steps {
        assert!(a.iter().chain(&b).all(|x| x.is_finite()), "non-finite logits at step {step}");
        for (x, y) in a.iter().zip(&b) {
            let d = (x - y).abs();
            sum += f64::from(d);
            max_abs = max_abs.max(d);
        }
        n += a.len();
        let next = argmax(&a);
        agree += usize::from(argmax(&b) == next);
        if step + 1 < steps {
            a = reference(&[next]);
            b = variant(&[next]);
        }
    }
    Figures { mean_abs: sum / n as f64, max_abs, agree, steps }
}
