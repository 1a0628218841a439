/**
 * The daemon: one explicit components object, started in order and stopped in reverse —
 * ledger → engines → (mesh → routing) → ingress to start; ingress (503 while closing) → routing →
 * engines → mesh → ledger flush to stop. Without an identity it is a single machine (`shoal serve`).
 */
import { join } from 'node:path'
import { Registry, collectDefaultMetrics } from 'prom-client'
import type { Logger } from 'pino'
import { loadOrCreateNodeKey } from '../../certs/index.ts'
import { createLocalService, loadBackend } from '../engine/index.ts'
import type { LocalService } from '../engine/index.ts'
import { createIngress } from '../ingress/index.ts'
import type { Ingress } from '../ingress/index.ts'
import { createLedger } from '../ledger/index.ts'
import type { Ledger } from '../ledger/index.ts'
import type { InferenceService } from '../service.ts'
import type { DaemonConfig } from './config.ts'
import { chooseEngine } from './device.ts'
import { createLifecycle } from './lifecycle.ts'
import type { Part } from './lifecycle.ts'
import { createModelDirectory } from './model-directory.ts'
import { resolveModel } from './models.ts'
import type { ResolvedModel } from './models.ts'
import { withReceipts } from './receipted-service.ts'

export interface DaemonComponents {
  logger: Logger
}

export interface Daemon {
  start: () => Promise<{ peerId: string, apiUrl?: string }>
  stop: () => Promise<void>
}

async function openvinoLoads (): Promise<boolean> {
  try {
    await loadBackend('openvino')
    return true
  } catch {
    return false
  }
}

export function createDaemon (config: Readonly<DaemonConfig>, components: DaemonComponents): Daemon {
  const { logger } = components
  const metrics = new Registry()
  collectDefaultMetrics({ register: metrics })
  let peerId = ''
  let ledger: Ledger | undefined
  let ingress: Ingress | undefined
  let apiUrl: string | undefined
  const models: ResolvedModel[] = []
  const services: LocalService[] = []

  const parts: Part[] = [
    {
      name: 'ledger',
      async start () {
        if (config.identityDir !== undefined) throw new Error('mesh mode is not wired yet')
        const key = await loadOrCreateNodeKey(join(config.dataDir, 'node.key'))
        peerId = key.peerId
        ledger = createLedger({ dataDir: config.dataDir, signer: { peerId: key.peerId, secretKey: key.secretKey } }, { logger })
        await ledger.start()
      },
      async stop () { await ledger?.stop() },
    },
    {
      name: 'engines',
      async start () {
        for (const spec of config.models) models.push(await resolveModel(spec, config.cacheRoot))
        const choice = chooseEngine(config.device, config.device === 'cpu' ? false : await openvinoLoads())
        for (const model of models.filter(m => m.whole)) {
          const service = createLocalService({
            shardDir: model.shardDir,
            nodeId: peerId,
            backend: choice.backend,
            device: choice.device,
            manifestHash: model.manifestHash,
          })
          await service.start()
          services.push(service)
          logger.info({ model: model.manifest.modelId, backend: choice.backend, device: choice.device }, 'model loaded')
        }
      },
      async stop () {
        await Promise.all(services.map(async s => { await s.stop() }))
      },
    },
    {
      name: 'ingress',
      async start () {
        if (config.api === undefined) return
        const service: InferenceService = withReceipts(createModelDirectory(services), ledger!)
        ingress = createIngress(
          { host: config.api.host, port: config.api.port, logger },
          { service, metrics, receipts: { get: async (id: string) => await ledger!.get(id) } },
        )
        apiUrl = (await ingress.start()).url
      },
      async stop () { await ingress?.stop() },
    },
  ]
  const lifecycle = createLifecycle(parts, (name, err) => { logger.error({ err, part: name }, 'stop failed') })

  return {
    async start () {
      await lifecycle.start()
      return apiUrl === undefined ? { peerId } : { peerId, apiUrl }
    },
    stop: lifecycle.stop,
  }
}
