/**
 * Shared pieces of the fuzz suite (test/fuzz/README.md lists what it covers).
 *
 * - `runs(name, base)`: fast-check parameters for one property. `base` keeps the whole suite well
 *   under 30 s on a loaded 2-core machine; `FUZZ_RUNS=20x` (or `FUZZ_RUNS=20`) multiplies every
 *   property's runs for a long run. With `FUZZ_REPORT=<dir>`, each file writes the runs of its
 *   properties there as JSON, so reproduction/results/fuzz.md counts inputs from what ran.
 * - `expectTyped(fn, err)`: the one property of every decoder: it returns, or throws its module's
 *   typed error (a class name and a SHOAL_ERR_* code) — never a TypeError, RangeError, or a
 *   stack overflow.
 * - `truncations` / `mutations`: the neighbours of a valid encoding.
 */
import { mkdirSync, writeFileSync } from 'node:fs'
import { basename, join } from 'node:path'
import fc from 'fast-check'
import { afterAll, expect } from 'vitest'

function multiplier (): number {
  const raw = process.env.FUZZ_RUNS
  if (raw === undefined || raw === '') return 1
  const n = Number(raw.replace(/x$/i, ''))
  if (!Number.isFinite(n) || n <= 0) throw new Error(`FUZZ_RUNS=${raw} is not a positive number (e.g. 20x)`)
  return n
}

const MULTIPLIER = multiplier()
const tally: Array<{ property: string, numRuns: number }> = []

/** fast-check parameters for a property: `base` runs, times FUZZ_RUNS; recorded for the report. */
export function runs (property: string, base: number): fc.Parameters<unknown> {
  const numRuns = Math.max(1, Math.round(base * MULTIPLIER))
  tally.push({ property, numRuns })
  return { numRuns }
}

/** Records a deterministic sweep (every truncation, every byte) under the same report. */
export function swept (property: string, inputs: number): void {
  tally.push({ property, numRuns: inputs })
}

/** Call once at the top of a fuzz test file: writes its tally when FUZZ_REPORT names a directory. */
export function reportRuns (file: string): void {
  afterAll(() => {
    const dir = process.env.FUZZ_REPORT
    if (dir === undefined || dir === '') return
    mkdirSync(dir, { recursive: true })
    writeFileSync(join(dir, `${basename(file)}.json`), JSON.stringify({ multiplier: MULTIPLIER, properties: tally }, null, 2))
  })
}

export interface TypedError {
  /** The error class's `name`, e.g. 'InferWireError'. */
  name: string | RegExp
  /** The code's prefix, e.g. 'SHOAL_ERR_INFER_'. */
  code: string
}

/**
 * Runs `fn`; if it throws, the error must be the typed one. Returns the value or undefined.
 * A failure names the input, so a counterexample can be pinned as a plain test case.
 */
export function expectTyped<T> (fn: () => T, typed: TypedError, input?: unknown): T | undefined {
  try {
    return fn()
  } catch (err) {
    const e = err as { name?: unknown, code?: unknown, message?: unknown }
    const what = `${String(e.name)} ${String(e.code)}: ${String(e.message).slice(0, 200)} for ${describe(input)}`
    if (typeof typed.name === 'string') expect(e.name, what).toBe(typed.name)
    else expect(String(e.name), what).toMatch(typed.name)
    expect(typeof e.code === 'string' && e.code.startsWith(typed.code), what).toBe(true)
    return undefined
  }
}

/** `expectTyped` for a promise. */
export async function expectTypedAsync<T> (fn: () => Promise<T>, typed: TypedError, input?: unknown): Promise<T | undefined> {
  let value: T
  try {
    value = await fn()
  } catch (err) {
    return expectTyped(() => { throw err }, typed, input)
  }
  return value
}

function describe (input: unknown): string {
  if (input === undefined) return '(input not given)'
  if (input instanceof Uint8Array) return `bytes ${Buffer.from(input.subarray(0, 96)).toString('hex')}${input.length > 96 ? '…' : ''} (${input.length})`
  try { return JSON.stringify(input)?.slice(0, 300) ?? String(input) } catch { return String(input) }
}

/** Every proper prefix of `bytes` (including empty). */
export function * truncations (bytes: Uint8Array): Generator<Uint8Array> {
  for (let n = 0; n < bytes.length; n++) yield bytes.subarray(0, n)
}

/** An arbitrary of one-byte changes of `bytes`: a position and a different byte value. */
export function mutation (bytes: Uint8Array): fc.Arbitrary<Uint8Array> {
  return fc.tuple(fc.nat(bytes.length - 1), fc.integer({ min: 1, max: 255 })).map(([at, delta]) => {
    const copy = bytes.slice()
    copy[at] = (copy[at]! + delta) & 0xff
    return copy
  })
}

/** An arbitrary of bytes near `valid`: a truncation, a one-byte change, a byte inserted or removed, junk appended. */
export function near (valid: Uint8Array): fc.Arbitrary<Uint8Array> {
  return fc.oneof(
    mutation(valid),
    fc.nat(valid.length).map(n => valid.slice(0, n)),
    fc.tuple(fc.nat(valid.length), fc.integer({ min: 0, max: 255 })).map(([at, b]) => Uint8Array.from([...valid.subarray(0, at), b, ...valid.subarray(at)])),
    fc.nat(valid.length - 1).map(at => Uint8Array.from([...valid.subarray(0, at), ...valid.subarray(at + 1)])),
    fc.uint8Array({ minLength: 1, maxLength: 16 }).map(junk => Uint8Array.from([...valid, ...junk])),
  )
}

/** Arbitrary bytes, and arbitrary JSON text as bytes (what a peer could send). */
export const anyBytes: fc.Arbitrary<Uint8Array> = fc.oneof(
  fc.uint8Array({ maxLength: 512 }),
  fc.json({ maxDepth: 4 }).map(j => new TextEncoder().encode(j)),
)

/** JSON values, lone surrogates and numbers at the edges included. */
export const anyJson: fc.Arbitrary<unknown> = fc.oneof(
  fc.jsonValue({ maxDepth: 4 }),
  fc.constantFrom('a\ud800b', '\udfff', '', -1, 2 ** 32, 2 ** 53, 1e308, -1e308, 0.5, [], {}, null, true),
)
