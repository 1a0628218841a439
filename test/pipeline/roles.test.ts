/**
 * /shoal/stage enforces certificate roles: a stage whose `authorize` refuses the upstream peer
 * (the daemon passes `roleRefusal('stage', …)`) answers the open frame with a typed
 * SHOAL_ERR_ROLE_REFUSED error, which ends the chain's request with that code, holding nothing.
 */
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { createChainTokenSource } from '../../daemon/pipeline/index.ts'
import { roleRefusal } from '../../daemon/node/roles.ts'
import { buildModels, chainFrom, eventually, holderOf, runSource, startStage, stopHost } from './fixture.ts'
import type { Models, StageHost } from './fixture.ts'

let models: Models
const hosts: StageHost[] = []
beforeAll(async () => { models = await buildModels() }, 120_000)
afterAll(async () => {
  for (const h of hosts) await stopHost(h).catch(() => {})
  await models?.cleanup()
})

describe('stage roles', () => {
  it('a stage refuses an upstream peer that is not a worker with a typed error; nothing is held', async () => {
    const coordinator = await startStage(models.two, [0, 1])
    hosts.push(coordinator)
    // The coordinator's certificate (as this stage's mesh admitted it) says ingress only.
    const refusing = await startStage(models.two, [2, 3], { authorize: from => roleRefusal('stage', ['worker'], from, ['ingress']) })
    hosts.push(refusing)
    const src = createChainTokenSource({
      node: coordinator.stage.node, requestId: 'roles-1', sampling: { temperature: 0, topP: 1 }, deadline: Date.now() + 30_000,
      formChain: chainFrom(coordinator, () => [holderOf(refusing)]),
    })
    try {
      await expect(runSource(src, [1, 17, 300], 4, AbortSignal.timeout(30_000))).rejects.toMatchObject({ code: 'SHOAL_ERR_ROLE_REFUSED', message: expect.stringMatching(/only worker certificates may ask/) })
    } finally {
      await src.close()
    }
    expect(await eventually(() => refusing.stage.node.stats(), v => v.served === 0)).toMatchObject({ served: 0 })
  }, 60_000)
})
