/**
 * Whether a target's shards verify exactly enough to speculate on (daemon/speculative's explicit
 * `--draft` refuses the others; the default prompt lookup skips them).
 */
import type { ShardManifest } from '../../shards/index.ts'

/**
 * Why speculation cannot keep this target's tokens exact, or undefined when it can. A verify step
 * runs K + 1 positions where plain decoding runs one; with f32 activations the two differ only in
 * the last bits (as padded batches do), but int8 activations turn those bits into whole
 * quantization steps: on a generated 250m int4 model a 2-position step chose a different token
 * than one-position decoding at a margin of 6e-3 (reproduction/results/speculative.md). Unless the
 * node runs the target on shoal's kernels for both (`kernels`, as capabilities name them): `int4`
 * (each row's products its own bits, however many rows) and `verify` (a verify step's attention
 * computed position by position as one-position steps compute it, daemon/engine/native), where a
 * verify step gives every position the bits of one-position decoding.
 */
export function inexactTarget (manifest: Pick<ShardManifest, 'quantization'>, kernels: readonly string[] = []): string | undefined {
  const needs = exactVerifyNeeds(manifest)
  if (needs === undefined || needs.every(k => kernels.includes(k))) return undefined
  const q = manifest.quantization
  return `its ${q.kind} shards compute in int8 activations, where a verify step of several positions can round to a different token than one-position decoding; compile it with --f32-activations (or serve it where shoal's kernels run it, --kernels) to speculate`
}

/** shoal's kernels a verify needs to be exact on this target (every stage of a chain's), or undefined where any runs it exactly. */
export function exactVerifyNeeds (manifest: Pick<ShardManifest, 'quantization'>): readonly string[] | undefined {
  const q = manifest.quantization
  return q.kind === 'none' || q.activations === 'f32' ? undefined : INT8_VERIFY_KERNELS
}

/** The kernels that make an int8-activation verify exact: row-invariant int4 products, and the verify attention. */
const INT8_VERIFY_KERNELS: readonly string[] = Object.freeze(['int4', 'verify'])
