/**
 * The two servers a side-by-side script compares (paired-vs-llamacpp.ts, cold-start.ts), as
 * `--arms` names them in JSON: "llama" for llama-server (`{"llama": [ARGS]}`: with arguments
 * added, as `--spec-type ngram-simple`), or `shoal serve` as a ShoalArm (lib/servers.ts: its
 * environment's variables alone, or `{"env", "dir", "shard", "args"}`). The reference comes first.
 */
import { ensureNativeShards } from './bench-models.ts'
import type { ModelFiles } from './bench-models.ts'
import { buildNativeKernels, nativeKernelsEnv } from './native-kernels.ts'
import { llamaEnv, llamaServerArgs } from './llamacpp.ts'
import type { LlamaShape } from './llamacpp.ts'
import { shoalArm, startLlama, startShoalArm } from './servers.ts'
import type { Server, ShoalArm } from './servers.ts'

export type Arm = { llama: string[] } | ShoalArm

export const isLlama = (a: Arm): a is { llama: string[] } => 'llama' in a

/** `--arms` JSON → two named arms, the reference first. */
export function parseArms (json: string): Array<[string, Arm]> {
  const arms = Object.entries(JSON.parse(json) as Record<string, 'llama' | { llama: string[] } | Record<string, string> | ShoalArm>)
    .map(([name, a]): [string, Arm] => {
      if (a === 'llama') return [name, { llama: [] }]
      if (typeof a === 'object' && 'llama' in a) {
        if (!Array.isArray(a.llama) || !a.llama.every(x => typeof x === 'string')) throw new Error(`arm ${name}: "llama" takes an array of llama-server arguments`)
        return [name, { llama: a.llama }]
      }
      return [name, shoalArm(a as Record<string, string> | ShoalArm)]
    })
  if (arms.length !== 2) throw new Error('--arms names two servers: the reference, then the one measured against it')
  return arms
}

/**
 * Starts `arm` on model `m`: llama-server from `bin` sized by `shape`, or shoal with its state
 * under `cache` — an arm with `native` on `m`'s shards compiled for the benchmark kernels it
 * names, their library preloaded (lib/native-kernels.ts).
 */
export async function startArm (arm: Arm, m: ModelFiles, bin: string, shape: LlamaShape, cache: string): Promise<Server> {
  if (isLlama(arm)) return await startLlama(bin, m.modelId, port => [...llamaServerArgs(m.gguf, port, shape), ...arm.llama], llamaEnv(undefined))
  if (arm.native !== undefined && arm.native !== false) {
    const env = { ...arm.env, ...nativeKernelsEnv(await buildNativeKernels()) }
    const kernels = arm.native === true ? 'attention' : arm.native
    return await startShoalArm({ ...arm, env, shard: arm.shard ?? await ensureNativeShards(m, kernels) }, m.shards, m.modelId, cache)
  }
  return await startShoalArm(arm, m.shards, m.modelId, cache)
}
