/**
 * Test helper: runs a shard directory's static graphs (StageManifest.static) directly with
 * onnxruntime-node, one sequence, KV buffers of CTX slots per layer written by the graphs:
 * prefill in [1, CHUNK] runs (the last one padded) while a whole chunk fits in the buffer, then
 * [1, 1] decode runs. Independent of the engine's static runner, so it tests the graph contract.
 */
import ort from 'onnxruntime-node'
import { join } from 'node:path'
import {
  ATTENTION_MASK, CACHE_POSITION, HIDDEN_IN, HIDDEN_OUT, INPUT_IDS, LOGITS, POSITION_IDS,
  pastKeyName, pastValueName, presentKeyName, presentValueName, type ShardManifest,
} from '../../shards/index.ts'

export interface StaticPipeline {
  manifest: ShardManifest
  prefill: ort.InferenceSession[]
  decode: ort.InferenceSession[]
  release: () => Promise<void>
}

export async function openStaticPipeline (dir: string, manifest: ShardManifest): Promise<StaticPipeline> {
  const opts = { intraOpNumThreads: 1, interOpNumThreads: 1 }
  const prefill: ort.InferenceSession[] = []
  const decode: ort.InferenceSession[] = []
  for (const s of manifest.stages) {
    if (s.static === undefined) throw new Error(`stage ${s.index} has no static graphs`)
    prefill.push(await ort.InferenceSession.create(join(dir, s.static.prefill), opts))
    decode.push(await ort.InferenceSession.create(join(dir, s.static.decode), opts))
  }
  return { manifest, prefill, decode, release: async () => { for (const s of [...prefill, ...decode]) await s.release() } }
}

const i64 = (v: number[], dims: number[]): ort.Tensor => new ort.Tensor('int64', BigInt64Array.from(v.map(BigInt)), dims)

/** Greedy decode over the static graphs: returns the tokens and the logits each token was picked from. */
export async function staticGreedy (p: StaticPipeline, prompt: number[], n: number): Promise<{ tokens: number[], logits: Float32Array[] }> {
  const { contextLength: C, chunk } = p.manifest.static!
  const { numKvHeads: kvH, headDim: hd, hiddenSize: D } = p.manifest.shape
  const kv = new Map<string, ort.Tensor>()
  for (let l = 0; l < p.manifest.shape.numLayers; l++) {
    for (const name of [pastKeyName(l), pastValueName(l)]) kv.set(name, new ort.Tensor('float32', new Float32Array(kvH * C * hd), [1, kvH, C, hd]))
  }
  let length = 0
  const tokens: number[] = []
  const all: Float32Array[] = []
  let pending = prompt
  while (tokens.length < n) {
    let last: Float32Array | undefined
    for (let a = 0; a < pending.length;) {
      const useChunk = pending.length - a > 1 && length + chunk <= C
      const S = useChunk ? chunk : 1
      const real = Math.min(S, pending.length - a)
      const ids = Array.from({ length: S }, (_, i) => (i < real ? pending[a + i]! : 0))
      const slots = Array.from({ length: S }, (_, i) => length + i)
      const mask = Array.from({ length: C }, (_, j) => (j < length + real ? 1 : 0))
      let hidden: ort.Tensor | undefined
      for (const [si, s] of p.manifest.stages.entries()) {
        const feeds: Record<string, ort.Tensor> = {
          [POSITION_IDS]: i64(slots, [1, S]), [CACHE_POSITION]: i64(slots, [S]), [ATTENTION_MASK]: i64(mask, [1, C]),
        }
        if (s.hasEmbedding) feeds[INPUT_IDS] = i64(ids, [1, S])
        else feeds[HIDDEN_IN] = hidden!
        for (let l = s.layers[0]; l <= s.layers[1]; l++) {
          feeds[pastKeyName(l)] = kv.get(pastKeyName(l))!
          feeds[pastValueName(l)] = kv.get(pastValueName(l))!
        }
        const out = await (useChunk ? p.prefill : p.decode)[si]!.run(feeds)
        for (let l = s.layers[0]; l <= s.layers[1]; l++) {
          kv.set(pastKeyName(l), out[presentKeyName(l)]!)
          kv.set(pastValueName(l), out[presentValueName(l)]!)
        }
        if (s.hasHead) {
          const V = out[LOGITS]!.dims[2]!
          last = (out[LOGITS]!.data as Float32Array).slice((real - 1) * V, real * V)
        } else {
          hidden = out[HIDDEN_OUT]!
          if (hidden.dims[1] !== S || hidden.dims[2] !== D) throw new Error(`hidden_states_out has shape [${hidden.dims.join(', ')}]`)
        }
      }
      length += real
      a += real
    }
    let best = 0
    for (let j = 1; j < last!.length; j++) if (last![j]! > last![best]!) best = j
    tokens.push(best)
    all.push(last!)
    pending = [best]
  }
  return { tokens, logits: all }
}
