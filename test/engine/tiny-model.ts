/**
 * Test fixture: a tiny random-weight Llama checkpoint compiled to a 1-stage fp32 shard directory
 * in a temp dir, via the shards module (generateTestModel + compileShards), and a started engine
 * worker over it.
 */
import { mkdtemp, rm } from 'node:fs/promises'
import { afterAll, beforeAll } from 'vitest'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { chooseStageGraphs, createStageEngine, resolveGraphChoice, stageInfoOf } from '../../daemon/engine/index.ts'
import type { BatchingStageEngine, StageEngineInit, StageInfo, StepOutput } from '../../daemon/engine/index.ts'
import { compileShards, generateTestModel } from '../../shards/index.ts'
import type { ShardManifest } from '../../shards/index.ts'

export interface TinyModel {
  shardDir: string
  graphPath: string
  manifest: ShardManifest
  cleanup (): Promise<void>
}

export async function buildTinyModel (architecture: 'llama' | 'qwen2' | 'qwen3' | 'phi3' = 'llama', opSet?: 'standard' | 'ort-contrib', staticShapes?: { contextLength: number, chunk: number }): Promise<TinyModel> {
  const dir = await mkdtemp(join(tmpdir(), 'shoal-engine-'))
  await generateTestModel({ architecture, outDir: join(dir, 'ckpt'), size: 'tiny' })
  const shardDir = join(dir, 'shard')
  const manifest = await compileShards({ modelDir: join(dir, 'ckpt'), outDir: shardDir, modelId: `tiny-${architecture}`, ...(opSet === undefined ? {} : { opSet }), ...(staticShapes === undefined ? {} : { static: staticShapes }) })
  const stage = manifest.stages[0]!
  return {
    shardDir,
    graphPath: join(shardDir, ...stage.graph.split('/')),
    manifest,
    cleanup: () => rm(dir, { recursive: true, force: true }),
  }
}

/** A started engine worker over a tiny model's whole graph. */
export interface TinyEngine {
  model: TinyModel
  stage: StageInfo
  engine: BatchingStageEngine
  /** Stops the engine, then removes the model's files. */
  stop (): Promise<void>
}

/**
 * Starts a worker-backed stage engine over `model` (default: a fresh tiny llama) with `init`
 * (threads, maxSequences, ...). If it does not start, what it made is stopped and removed before
 * the error is thrown, so a failed beforeAll leaves no temp dir behind.
 */
export async function startTinyEngine (init: Omit<StageEngineInit, 'graphPath' | 'stage'>, model?: TinyModel): Promise<TinyEngine> {
  const m = model ?? await buildTinyModel()
  const stage = stageInfoOf(m.manifest)
  // The graphs a node would run: with 'ort-contrib' shards, the one-position graph beside the stage graph.
  const engine = createStageEngine({ ...resolveGraphChoice(m.shardDir, chooseStageGraphs(m.manifest, 0, 'CPU', 'dynamic', init.backend ?? 'onnxruntime')), stage, ...init })
  const stop = async (): Promise<void> => {
    try { await engine.stop() } finally { await m.cleanup() }
  }
  try {
    await engine.start()
  } catch (err) {
    await stop().catch(() => {})
    throw err
  }
  return { model: m, stage, engine, stop }
}

/** Deterministic pseudo-random token ids in [3, vocab) (the specials below 3 left out). */
export function randomTokenIds (n: number, seed: number, vocab: number): number[] {
  let x = seed * 2654435761 >>> 0
  return Array.from({ length: n }, () => { x = (x * 1103515245 + 12345) >>> 0; return 3 + (x >>> 8) % (vocab - 3) })
}

/** The token of a step that carried a pick, failing the test on any other output. */
export function tokenIdOf (out: StepOutput): number {
  if (out.kind !== 'token') throw new Error(`expected a token, got ${out.kind}`)
  return out.id
}

/**
 * A tiny engine for the describe block this is called in: started before its tests and stopped
 * after them; read `engine` and `vocab` inside the tests.
 */
export function tinyEngineForSuite (init: Omit<StageEngineInit, 'graphPath' | 'stage'>): { readonly engine: BatchingStageEngine, readonly vocab: number } {
  let tiny: TinyEngine | undefined
  beforeAll(async () => { tiny = await startTinyEngine(init) }, 120_000)
  afterAll(async () => { await tiny?.stop() })
  const started = (): TinyEngine => {
    if (tiny === undefined) throw new Error('the tiny engine has not started')
    return tiny
  }
  return {
    get engine () { return started().engine },
    get vocab () { return started().model.manifest.shape.vocabSize },
  }
}
