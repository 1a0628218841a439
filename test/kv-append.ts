/**
 * For tests that run stage graphs by hand: the past a step leaves for layer `l`. Graphs that keep a
 * present output it; 'ort-contrib' graphs (compiler ≥ 5) output only the step's new columns
 * (`new_key_values`, [B, kvH, S, hd]), which are appended here to the past the step was fed
 * ([B, kvH, P, hd]) — what an engine keeping its KV in place does.
 */
import { alignColumns } from '../daemon/engine/kv-block.ts'
import { newKeyName, newValueName, presentKeyName, presentValueName } from '../shards/contract.ts'

interface F32 { data: Float32Array, dims: readonly number[] }

export function nextPast (out: Record<string, { data: unknown, dims: readonly number[] } | undefined>, past: F32 | undefined, l: number, kind: 'key' | 'value', lengths?: readonly number[]): { data: Float32Array, dims: number[] } {
  const present = out[kind === 'key' ? presentKeyName(l) : presentValueName(l)]
  if (present !== undefined) return { data: present.data as Float32Array, dims: [...present.dims] }
  const add = out[kind === 'key' ? newKeyName(l) : newValueName(l)]
  if (add === undefined) throw new Error(`the step output neither present nor new_key_values for layer ${l}`)
  const [B, kvH, S, hd] = add.dims as [number, number, number, number]
  const P = past?.dims[2] ?? 0
  // Right-padded rows (`lengths`: each row's live past): row b's new columns go after its own
  // live ones, as in GroupQueryAttention's present; columns nobody wrote stay zero (finite). With
  // `lengths` the buffer is as wide as an engine's block would be (a multiple of 16 columns, which
  // one-position steps need for a row's bits not to depend on the width: kv-block.ts).
  const at = lengths ?? new Array<number>(B).fill(P)
  const live = Math.max(P, ...at.map(n => n + S))
  const width = lengths === undefined ? live : alignColumns(live)
  const data = new Float32Array(B * kvH * width * hd)
  const src = add.data as Float32Array
  for (let b = 0; b < B; b++) {
    for (let h = 0; h < kvH; h++) {
      const r = b * kvH + h
      if (past !== undefined && P > 0) data.set(past.data.subarray(r * P * hd, (r + 1) * P * hd), r * width * hd)
      data.set(src.subarray(r * S * hd, (r + 1) * S * hd), (r * width + at[b]!) * hd)
    }
  }
  return { data, dims: [B, kvH, width, hd] }
}
