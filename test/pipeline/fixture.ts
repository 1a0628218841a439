/**
 * Test fixture: one tiny random-weight checkpoint compiled three ways (whole, 2 stages, 3 stages),
 * bare libp2p 3.x nodes on loopback (TCP + noise + yamux) each serving one stage with its own
 * StageEngine, and a reference greedy/sampled decode on the unsplit model through the engine.
 */
import { mkdtemp, rm } from 'node:fs/promises'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import type { Libp2p } from '@libp2p/interface'
import { createRng, createStageEngine, sampleToken, stageInfoOf } from '../../daemon/engine/index.ts'
import type { StageEngine, TokenSource } from '../../daemon/engine/index.ts'
import { createPipelineStage } from '../../daemon/pipeline/index.ts'
import type { ChainHop, PipelineStage, PipelineStageInit } from '../../daemon/pipeline/index.ts'
import { ChainIncompleteError, formChain } from '../../daemon/routing/index.ts'
import type { StageHolder } from '../../daemon/routing/index.ts'
import type { GenerateRequest, SamplingParams } from '../../daemon/service.ts'
import { compileShards, generateTestModel } from '../../shards/index.ts'
import type { ShardManifest } from '../../shards/index.ts'
import { linkComponents, loopbackNode } from '../../reproduction/lib/loopback.ts'

/** The model id every shard directory of `buildModels` serves. */
export const MODEL_ID = 'chain-test'

export interface Models {
  root: string
  whole: string
  two: string
  three: string
  manifest: ShardManifest
  cleanup (): Promise<void>
}

export async function buildModels (size: 'tiny' | '60m' = 'tiny', quant: 'none' | 'int4' = 'none'): Promise<Models> {
  const root = await mkdtemp(join(tmpdir(), 'shoal-pipeline-'))
  const ckpt = join(root, 'ckpt')
  await generateTestModel({ architecture: 'llama', outDir: ckpt, size })
  const opts = { modelDir: ckpt, modelId: MODEL_ID, quant }
  const manifest = await compileShards({ ...opts, outDir: join(root, 'whole') })
  const L = manifest.shape.numLayers
  await compileShards({ ...opts, outDir: join(root, 'two'), stages: 2 })
  await compileShards({ ...opts, outDir: join(root, 'three'), layers: [[0, Math.floor(L / 2) - 1], [Math.floor(L / 2), L - 2], [L - 1, L - 1]] })
  return { root, whole: join(root, 'whole'), two: join(root, 'two'), three: join(root, 'three'), manifest, cleanup: () => rm(root, { recursive: true, force: true }) }
}

/**
 * A greedy request for the fixture's model with a minute to finish: `prompt` is token ids or any
 * prompt the service takes; `over` replaces any field.
 */
export function chainRequest (requestId: string, prompt: number[] | GenerateRequest['prompt'], maxTokens: number, over: Partial<GenerateRequest> = {}): GenerateRequest {
  return {
    requestId,
    model: MODEL_ID,
    prompt: Array.isArray(prompt) ? { kind: 'tokens', ids: prompt } : prompt,
    maxTokens,
    sampling: { temperature: 0, topP: 1 },
    stop: [],
    deadline: Date.now() + 60_000,
    ...over,
  }
}

/** Where each test node listens, so any node can dial any other by peer id. */
const addressBook = new Map<string, Libp2p>()

export async function createNode (): Promise<Libp2p> {
  const node = await loopbackNode()
  addressBook.set(node.peerId.toString(), node)
  return node
}

export function componentsOf (node: Libp2p): Parameters<typeof createPipelineStage>[1] {
  return linkComponents(node, addressBook)
}

export interface StageHost { libp2p: Libp2p, stage: PipelineStage, peerId: string }

export async function startStage (shardDir: string, layers: [number, number], options: Partial<Omit<PipelineStageInit, 'shardDir' | 'layers'>> = {}): Promise<StageHost> {
  const libp2p = await createNode()
  const stage = await createPipelineStage({ shardDir, layers, threads: 1, ...options }, componentsOf(libp2p))
  await stage.start()
  return { libp2p, stage, peerId: libp2p.peerId.toString() }
}

/** Stops a host abruptly: connections aborted first, then the node and engine. */
export async function kill (h: StageHost): Promise<void> {
  for (const c of h.libp2p.getConnections()) c.abort(new Error('killed by test'))
  await h.libp2p.stop()
  await h.stage.stop()
}

export async function stopHost (h: StageHost): Promise<void> {
  await h.stage.stop()
  await h.libp2p.stop()
}

export function holderOf (h: StageHost, rttMs = 1): StageHolder {
  const s = h.stage.served()
  return { peerId: h.peerId, modelId: s.id, manifestHash: s.manifestHash, layers: s.layers, admitted: true, alive: true, rttMs }
}

/** A formChain callback for chain token sources: the coordinator first, then the cheapest holders. */
export function chainFrom (coordinator: StageHost, holders: () => StageHolder[]): (exclude: readonly string[]) => ChainHop[] {
  return (exclude) => {
    const d = formChain([holderOf(coordinator, 0), ...holders()], { now: Date.now(), modelId: 'chain-test', numLayers: coordinator.stage.manifest.shape.numLayers, exclude })
    if (d.kind !== 'chain') throw new ChainIncompleteError(d.reason)
    return d.stages.map(s => ({ peerId: s.peerId, layers: [s.layers[0], s.layers[1]] }))
  }
}

/** The decode loop a TokenSource plugs into, reduced to token ids. */
export async function runSource (source: TokenSource, prompt: number[], n: number, signal: AbortSignal, onToken?: (i: number) => Promise<void> | void): Promise<number[]> {
  const out: number[] = []
  let t = await source.prefill(prompt, signal)
  out.push(t)
  while (out.length < n) {
    await onToken?.(out.length)
    t = await source.decode(t, prompt.length + out.length - 1, signal)
    out.push(t)
  }
  return out
}

export async function startWholeEngine (models: Models): Promise<StageEngine> {
  const st = models.manifest.stages[0]!
  const engine = createStageEngine({ graphPath: join(models.whole, ...st.graph.split('/')), stage: stageInfoOf(models.manifest), threads: 1 })
  await engine.start()
  return engine
}

/** Reference: the unsplit model through the engine, sampling with the same functions. */
export async function referenceTokens (engine: StageEngine, prompt: number[], n: number, sampling: SamplingParams = { temperature: 0, topP: 1 }): Promise<number[]> {
  const rng = createRng(sampling.seed)
  const seq = await engine.open()
  const out: number[] = []
  try {
    let res = await engine.step(seq, { tokenIds: prompt }, prompt.map((_, i) => i))
    for (;;) {
      if (res.kind !== 'logits') throw new Error('whole model returned no logits')
      const t = sampleToken(res.data, sampling, rng, (res.count - 1) * res.vocab, res.vocab)
      out.push(t)
      if (out.length >= n) return out
      res = await engine.step(seq, { tokenIds: [t] }, [prompt.length + out.length - 1])
    }
  } finally {
    await engine.free(seq)
  }
}

/** Waits (bounded) until `check` holds; returns its last value. */
export async function eventually<T> (read: () => Promise<T> | T, check: (v: T) => boolean, ms = 5_000): Promise<T> {
  const until = Date.now() + ms
  let v = await read()
  while (!check(v) && Date.now() < until) {
    await new Promise(resolve => setTimeout(resolve, 20))
    v = await read()
  }
  return v
}
