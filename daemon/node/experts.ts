/**
 * The daemon's mixture-of-experts parts (daemon/experts), in one place so the daemon only starts
 * and stops them:
 *  - holder (`--hold-experts DIR`): keeps experts of an expert-parallel shard directory resident
 *    (loaded on first use, within --expert-memory-mb), answers /shoal/experts/2.0.0 from worker
 *    peers, signs a receipt part per request when its stage finishes it, and gossips what it offers (capabilities `experts`: the shards key and its budget);
 *  - stage (`--model DIR` of an expert-parallel shard directory): serves the model over the API,
 *    running attention and the router here and the experts on the holders the mesh gossips, the
 *    plan shown in /v1/mesh.
 * Both need the mesh (`shoal node --identity`).
 */
import { join } from 'node:path'
import type { Logger } from 'pino'
import { int4KernelName, int4ProductsTakeKernel, prepareNativeKernels } from '../engine/index.ts'
import {
  createExpertHolder, createExpertLinks, createExpertService, isExpertShardDir, openExpertShards, serveExperts,
  type ExpertHolder, type ExpertLink, type ExpertPlanView, type ExpertService, type ExpertShards,
} from '../experts/index.ts'
import type { ExpertsCapability, Mesh, ServedModel } from '../mesh/index.ts'
import { ConfigError } from './config.ts'
import type { Budgets, DaemonConfig, ModelEntry } from './config.ts'
import type { Part } from './lifecycle.ts'
import { expertHolderNodes } from './mesh-view.ts'
import type { PeerLossWatch } from './peer-loss.ts'
import { roleRefusal } from './roles.ts'

const MIB = 1024 * 1024

/** A --model that names an expert-parallel shard directory (served by the experts part, not an engine). */
export function isExpertModel (spec: ModelEntry): boolean {
  return spec.dir !== 'demo' && spec.layers === undefined && isExpertShardDir(spec.dir)
}

export interface ExpertsPartDeps {
  logger: Logger
  mesh: () => Mesh | undefined
  peerLoss: () => PeerLossWatch | undefined
  /** This node's certificate roles. */
  roles: () => readonly string[]
  nodeId: () => string
  /** This node's key: a holder signs a receipt part per request with it. */
  signer?: () => { peerId: string, secretKey: Uint8Array }
  budgets: Budgets
}

/** What /v1/mesh shows: the plans of the models staged here, the experts held here. */
export interface ExpertsView {
  plans: ExpertPlanView[]
  holding?: { model: string, key: string, budgetBytes: number, resident: Array<{ layer: number, experts: number[] }>, steps: number }
}

export interface ExpertsPart extends Part {
  /** Services of the expert-parallel models staged here (started by this part). */
  readonly services: ExpertService[]
  /** Served models and held experts, for the capability record. */
  served: () => ServedModel[]
  held: () => ExpertsCapability[] | undefined
  view: () => ExpertsView | undefined
}

export function createExpertsPart (config: Readonly<DaemonConfig>, deps: ExpertsPartDeps): ExpertsPart {
  const services: ExpertService[] = []
  const staged: ExpertShards[] = []
  const stops: Array<() => Promise<void> | void> = []
  let holding: { shards: ExpertShards, holder: ExpertHolder, budgetBytes: number } | undefined
  /** The shards keys whose graphs run shoal's int4 kernel here (capabilities). */
  const onKernel = new Set<string>()

  /**
   * shoal's kernel library for expert-parallel shards whose products it takes (int4, block 32,
   * int8 activations; `--kernels auto`), and what their loaded line says of it: the stage's graphs
   * and the holder's experts run the same kernel as a whole model's engine would, so a model's
   * tokens do not depend on whether its experts are spread.
   */
  async function kernelsFor (shards: ExpertShards): Promise<{ lib: { kernels?: string }, facts: { int4Kernel?: string } }> {
    if (!int4ProductsTakeKernel(shards.layout.quantization)) return { lib: {}, facts: {} }
    if (config.kernels === 'onnxruntime') return { lib: {}, facts: { int4Kernel: int4KernelName(false) } }
    const kernels = await prepareNativeKernels(join(config.cacheRoot, 'kernels'))
    if ('off' in kernels) return { lib: {}, facts: { int4Kernel: int4KernelName(false, kernels) } }
    onKernel.add(shards.key)
    return { lib: { kernels: kernels.lib }, facts: { int4Kernel: int4KernelName(true) } }
  }

  function meshFor (flag: string, what: string): Mesh {
    const m = deps.mesh()
    if (m === undefined) throw new ConfigError(flag, `${what}: experts live on holders in the mesh (shoal node --identity DIR)`)
    return m
  }

  async function startStage (spec: ModelEntry, m: Mesh): Promise<void> {
    const shards = await openExpertShards(spec.dir)
    const kernels = await kernelsFor(shards)
    const links = createExpertLinks({
      handle: async () => { throw new Error('a stage does not serve /shoal/experts') },
      openStream: async (peer, protocol, signal) => await m.openStream(peer, protocol, signal),
    })
    stops.push(() => { links.stop() })
    // A holder the mesh stops hearing from fails its steps at once (its copies take over), not at
    // the step's time bound.
    const link: ExpertLink = async (peerId, parts, signal) => {
      const lost = deps.peerLoss()?.watch(peerId)
      try {
        return await links.link(peerId, parts, lost === undefined ? signal : AbortSignal.any([signal, lost.signal]))
      } finally {
        lost?.release()
      }
    }
    const service = createExpertService(
      { shards, nodeId: m.peerId, stepTimeoutMs: Math.min(deps.budgets.networkIdleMs, 30_000), budgetMs: deps.budgets.batchBudgetMs, gatherMs: deps.budgets.batchQueueDelayMs, ...kernels.lib },
      { holders: () => expertHolderNodes(shards.key, m.peers()), link },
    )
    await service.start()
    stops.push(async () => { await service.stop() })
    services.push(service)
    staged.push(shards)
    deps.logger.info({ model: shards.modelId, key: shards.key, experts: shards.experts, ...kernels.facts }, 'model loaded with its experts on holders')
  }

  async function startHolder (hold: NonNullable<DaemonConfig['holdExperts']>, m: Mesh): Promise<void> {
    const roles = deps.roles()
    if (!roles.includes('worker')) throw new ConfigError('--hold-experts', `holding experts for stage nodes needs a worker certificate (this node's roles: ${roles.join(',')})`)
    const shards = await openExpertShards(hold.dir)
    const budgetBytes = hold.memoryMb === undefined ? shards.experts * shards.expertBytes : Math.floor(hold.memoryMb * MIB)
    const maxExperts = Math.floor(budgetBytes / shards.expertBytes)
    if (maxExperts < 1) throw new ConfigError('--expert-memory-mb', `one expert of ${shards.modelId} needs ${(shards.expertBytes / MIB).toFixed(3)} MiB`)
    const signer = deps.signer?.()
    const kernels = await kernelsFor(shards)
    const holder = createExpertHolder({
      dir: shards.dir, layout: shards.layout, model: shards.key, modelId: shards.modelId, experts: [], maxExperts, ...kernels.lib,
      ...(signer === undefined ? {} : { signer: { peerId: signer.peerId, secretKey: signer.secretKey } }),
    })
    await holder.start()
    stops.push(async () => { await holder.stop() })
    const server = await serveExperts(holder, {
      handle: async (protocol, handler) => {
        await m.handle(protocol, (stream, connection) => {
          const from = connection.remotePeer.toString()
          const refused = roleRefusal('experts', roles, from, m.certificateOf(from)?.body.roles)
          if (refused !== undefined) { stream.abort(refused); return }
          return handler(stream, connection)
        })
      },
      openStream: async (peer, protocol, signal) => await m.openStream(peer, protocol, signal),
    })
    stops.push(async () => { await server.stop() })
    holding = { shards, holder, budgetBytes: maxExperts * shards.expertBytes }
    deps.logger.info({ model: shards.modelId, key: shards.key, maxExperts, of: shards.experts, ...kernels.facts }, 'holding experts for stage nodes')
  }

  return {
    name: 'experts',
    services,
    async start () {
      const specs = config.models.filter(isExpertModel)
      for (const spec of specs) await startStage(spec, meshFor('--model', spec.dir))
      if (config.holdExperts !== undefined) await startHolder(config.holdExperts, meshFor('--hold-experts', config.holdExperts.dir))
    },
    async stop () {
      // Idempotent: the engines part stops the services too (they are among its coordinators).
      for (const stop of stops.splice(0).reverse()) await stop()
      holding = undefined
    },
    served: () => staged.map(s => ({ id: s.modelId, manifestHash: s.key, totalLayers: s.layout.shape.numLayers, maxContextTokens: s.layout.shape.maxPositions, ...(onKernel.has(s.key) ? { kernels: ['int4'] } : {}) })),
    held: () => holding === undefined ? undefined : [{ model: holding.shards.key, modelId: holding.shards.modelId, budgetBytes: holding.budgetBytes }],
    view () {
      if (services.length === 0 && holding === undefined) return undefined
      return {
        plans: services.flatMap(s => { const p = s.plan(); return p === undefined ? [] : [p] }),
        ...(holding === undefined
          ? {}
          : { holding: { model: holding.shards.modelId, key: holding.shards.key, budgetBytes: holding.budgetBytes, resident: holding.holder.resident(), steps: holding.holder.stats().steps } }),
      }
    },
  }
}
