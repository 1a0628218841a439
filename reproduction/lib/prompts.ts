/**
 * Deterministic prompts for the benchmarks: the same ids on every run and every machine, so two
 * runs (or two checkouts, side by side) feed the same tokens, and greedy outputs can be compared.
 * Every id stays inside the test tokenizer's 512 real tokens and above its 3 special ones.
 */

/** n ids 3 + (37·i + 101·salt) mod 500: a different, fixed prompt for each salt. */
export function promptIds (n: number, salt = 0): number[] {
  return Array.from({ length: n }, (_, i) => 3 + ((i * 37 + salt * 101) % 500))
}

/**
 * n pseudo-random ids in [3, min(vocab, 500)), from a 32-bit linear congruential generator seeded
 * by `seed`: histories and follow-ups that share no accidental runs with each other.
 */
export function lcgTokens (n: number, seed: number, vocab = 500): number[] {
  let x = seed * 2654435761 >>> 0
  return Array.from({ length: n }, () => { x = (x * 1103515245 + 12345) >>> 0; return 3 + (x >>> 8) % (Math.min(vocab, 500) - 3) })
}

/** Stream i's prompt in the pipeline benchmarks: n ids 1 + (131·i + 37·j) mod 500. */
export function streamPromptIds (i: number, n: number): number[] {
  return Array.from({ length: n }, (_, j) => 1 + ((i * 131 + j * 37) % 500))
}

/** Stream i's prompt in the expert benchmarks: 12 to 16 ids (ragged, so batches pad), 40 + (31·i + 7·j) mod 400. */
export function raggedPromptIds (i: number): number[] {
  return Array.from({ length: 12 + (i % 5) }, (_, j) => 40 + ((i * 31 + j * 7) % 400))
}
