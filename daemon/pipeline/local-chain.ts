/**
 * Every stage of a split model on one machine (`shoal serve --model SHARDDIR` on a multi-stage
 * shard directory): one PipelineStage per stage, each with its own engine worker and its own device
 * (the single-PC CPU + iGPU + NPU split), chained by the same coordinator and the same
 * /shoal/stage/1.0.0 frames a mesh uses — so a user checks a split on one machine, token for token,
 * before deploying it. The stages talk over libp2p on 127.0.0.1 (TCP, Noise, Yamux) with
 * throwaway keys; each stage accepts streams only from its sibling stages' peer ids, which Noise
 * authenticates, so no other local process can feed it frames.
 */
import type { Libp2p } from '@libp2p/interface'
import type { Registry } from 'prom-client'
import type { BatchLimits } from '../batcher/index.ts'
import type { BackendName, GraphMode } from '../engine/index.ts'
import type { StageHolder } from '../routing/index.ts'
import { loadManifest } from '../../shards/index.ts'
import { StageConfigError } from './errors.ts'
import type { LinkComponents } from './links.ts'
import { createPipelineService } from './service.ts'
import type { PipelineService } from './service.ts'
import { createPipelineStage } from './stage.ts'
import type { PipelineStage } from './stage.ts'

/**
 * libp2p and its loopback transport stack, loaded when a local chain starts: a whole-model
 * `shoal serve` imports this module and never runs a chain (mesh.ts says what this saves).
 */
async function loopbackLibp2p () {
  const [{ createLibp2p }, { tcp }, { noise }, { yamux }] = await Promise.all([import('libp2p'), import('@libp2p/tcp'), import('@chainsafe/libp2p-noise'), import('@chainsafe/libp2p-yamux')])
  return { createLibp2p, tcp, noise, yamux }
}

export interface LocalChainInit {
  shardDir: string
  /** The engine of each stage, in stage order; one entry applies to every stage. */
  engines: Array<{ backend: BackendName, device: string }>
  /** Signs each stage's receipt part (the node's key). */
  signer?: { peerId: string, secretKey: Uint8Array }
  metrics?: Registry
  batchLimits?: Partial<BatchLimits>
  threads?: number
  /** The node's compiled-model cache, shared by every stage (compiledCacheDir). */
  cacheDir?: string
  /** shoal's kernel library, for every stage on onnxruntime (EngineHostOptions.kernels). */
  kernels?: string
  /** Dynamic or static graphs for every stage; 'auto' (default): static on stages whose device needs them (NPU). */
  graphs?: GraphMode
  /**
   * Bytes of KV the chain keeps from finished requests for prefix reuse, shared by its stages in
   * proportion to their layers (each position's KV is); 0 or absent: none.
   */
  kvCacheBytes?: number
}

export interface LocalChain {
  /** Stage 0's coordinator: the InferenceService of the whole model. */
  readonly service: PipelineService
  /** The stages in order (after start). */
  readonly stages: readonly PipelineStage[]
  start (): Promise<void>
  stop (): Promise<void>
}

export function createLocalChain (init: LocalChainInit): LocalChain {
  const hosts: Libp2p[] = []
  const stages: PipelineStage[] = []
  let service: PipelineService | undefined
  const byPeer = new Map<string, Libp2p>()

  function componentsOf (host: Libp2p): LinkComponents {
    return {
      peerId: host.peerId.toString(),
      handle: async (protocol, handler) => {
        await host.handle(protocol, (stream, connection) => {
          if (!byPeer.has(connection.remotePeer.toString())) {
            stream.abort(new Error('not a stage of this chain'))
            return
          }
          return handler(stream, connection)
        })
      },
      unhandle: async protocol => { await host.unhandle(protocol) },
      openStream: async (peerId, protocol, signal) => {
        const target = byPeer.get(peerId)
        if (target === undefined) throw new StageConfigError(`${peerId} is not a stage of this chain`)
        return await host.dialProtocol(target.getMultiaddrs(), protocol, { signal })
      },
    }
  }

  async function stopAll (): Promise<void> {
    await service?.stop()
    for (const s of [...stages].reverse()) await s.stop().catch(() => {})
    for (const h of hosts) {
      try {
        await h.stop()
      } catch {}
    }
    stages.length = 0
    hosts.length = 0
    byPeer.clear()
    service = undefined
  }

  return {
    get service () {
      if (service === undefined) throw new StageConfigError('the local chain is not started')
      return service
    },
    get stages () { return stages },
    async start () {
      const manifest = await loadManifest(init.shardDir)
      const n = manifest.stages.length
      if (init.engines.length !== 1 && init.engines.length !== n) {
        throw new StageConfigError(`${init.shardDir} has ${n} stages but ${init.engines.length} devices were given (give one, or one per stage)`)
      }
      try {
        const { createLibp2p, tcp, noise, yamux } = await loopbackLibp2p()
        for (let i = 0; i < n; i++) {
          const host = await createLibp2p({
            addresses: { listen: ['/ip4/127.0.0.1/tcp/0'] },
            transports: [tcp()],
            connectionEncrypters: [noise()],
            streamMuxers: [yamux()],
            connectionMonitor: { enabled: false },
          })
          hosts.push(host)
          byPeer.set(host.peerId.toString(), host)
        }
        for (const [i, st] of manifest.stages.entries()) {
          const engine = init.engines.length === 1 ? init.engines[0]! : init.engines[i]!
          const stage = await createPipelineStage({
            shardDir: init.shardDir,
            layers: [st.layers[0], st.layers[1]],
            backend: engine.backend,
            device: engine.device,
            ...(init.signer === undefined ? {} : { signer: init.signer }),
            ...(init.metrics === undefined ? {} : { metrics: init.metrics }),
            ...(init.batchLimits === undefined ? {} : { batchLimits: init.batchLimits }),
            ...(init.threads === undefined ? {} : { threads: init.threads }),
            ...(init.cacheDir === undefined ? {} : { cacheDir: init.cacheDir }),
            ...(init.kernels === undefined ? {} : { kernels: init.kernels }),
            ...(init.graphs === undefined ? {} : { graphs: init.graphs }),
            ...(init.kvCacheBytes === undefined ? {} : { kvCacheBytes: Math.floor(init.kvCacheBytes * (st.layers[1] - st.layers[0] + 1) / manifest.shape.numLayers) }),
          }, componentsOf(hosts[i]!))
          await stage.start()
          stages.push(stage)
        }
        // The chain is fixed: every stage but the first, each on its own host, always alive.
        const holders: StageHolder[] = stages.slice(1).map(s => {
          const served = s.served()
          return { peerId: s.node.peerId, modelId: served.id, manifestHash: served.manifestHash, layers: served.layers, admitted: true, alive: true, rttMs: 0 }
        })
        // The chain holds what its smallest stage holds (a stage on static graphs: its KV budget).
        const maxContextTokens = Math.min(...stages.map(s => s.served().maxContextTokens))
        const coordinator = createPipelineService({ stage: stages[0]!, shardDir: init.shardDir, maxContextTokens, ...(init.metrics === undefined ? {} : { metrics: init.metrics }) }, { holders: () => holders })
        await coordinator.start()
        service = coordinator
      } catch (err) {
        await stopAll()
        throw err
      }
    },
    stop: stopAll,
  }
}
