/**
 * Turns --model arguments into shard directories the engine can load: a shard directory is used
 * as it is, a Hugging Face checkpoint is compiled once into the cache (keyed by its content hash),
 * and 'demo' is the built-in random-weight model, generated on first use.
 */
import { existsSync } from 'node:fs'
import { compileCached, ensureDemoModel, isShardDir, loadManifest, manifestHash } from '../../shards/index.ts'
import type { CompileCacheProgress, ShardManifest } from '../../shards/index.ts'
import { ConfigError } from './config.ts'
import type { ModelEntry } from './config.ts'

export interface ResolvedModel {
  shardDir: string
  manifest: ShardManifest
  /** sha256 (hex) of manifest.json: names the exact weights in gossip, chains and receipts. */
  manifestHash: string
  /** Index of the stage this node serves. */
  stageIndex: number
  /** True when this node holds the whole model (one stage with embedding and head). */
  whole: boolean
  /** Every stage of a multi-stage shard directory, run here as a local chain (`shoal serve`). */
  localChain?: boolean
}

/**
 * What preparing a model reports; only work that actually happens (a cache miss) is reported.
 * A checkpoint compiled into the cache takes the per-head one-position attention whatever the
 * CPU, not the form a timing would pick: the form is in the manifest, whose hash names the model
 * to chains and scopes KV prefixes, so nodes compiling the same checkpoint must arrive at the same
 * manifest — a timing near its margin could split even identical machines (shards/DESIGN.md).
 * `shoal shard` times this CPU's faster form for a shard directory made once and copied.
 */
export interface ModelProgress extends CompileCacheProgress {
  onGenerate?: (dir: string) => void
}

export async function resolveModel (spec: ModelEntry, cacheRoot: string, progress: ModelProgress = {}): Promise<ResolvedModel> {
  if (spec.dir !== 'demo' && !existsSync(spec.dir)) throw new ConfigError('--model', `${spec.dir} does not exist`)
  let shardDir: string
  if (spec.dir === 'demo') shardDir = await ensureDemoReady(cacheRoot, progress)
  else if (isShardDir(spec.dir)) shardDir = spec.dir
  else if (spec.layers !== undefined) throw new ConfigError('--model', `${spec.dir}@${spec.layers.join('-')}: a layer range needs a shard directory (make one with shoal shard)`)
  else shardDir = await compileCached(spec.dir, cacheRoot, progress)

  const manifest = await loadManifest(shardDir)
  let stageIndex = 0
  if (spec.layers !== undefined) {
    const [a, b] = spec.layers
    stageIndex = manifest.stages.findIndex(s => s.layers[0] === a && s.layers[1] === b)
    if (stageIndex < 0) {
      const have = manifest.stages.map(s => `${s.layers[0]}-${s.layers[1]}`).join(', ')
      throw new ConfigError('--model', `${spec.dir} has no stage with layers ${a}-${b} (stages: ${have})`)
    }
  } else if (manifest.stages.length !== 1) {
    // No stage picked: serve them all here, chained (each stage its own engine worker).
    return { shardDir, manifest, manifestHash: await manifestHash(shardDir), stageIndex: 0, whole: false, localChain: true }
  }
  const stage = manifest.stages[stageIndex]!
  return { shardDir, manifest, manifestHash: await manifestHash(shardDir), stageIndex, whole: stage.hasEmbedding && stage.hasHead }
}

/** Generates and compiles the demo model once, so N daemons starting together don't race to. */
export async function ensureDemoReady (cacheRoot: string, progress: ModelProgress = {}): Promise<string> {
  const demo = await ensureDemoModel(cacheRoot, progress.onGenerate === undefined ? {} : { onGenerate: progress.onGenerate })
  return await compileCached(demo, cacheRoot, progress)
}
