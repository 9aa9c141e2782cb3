"""Websocket consumers: a browser follows one task's event log, or the task list."""

from channels.generic.websocket import AsyncJsonWebsocketConsumer


class TaskConsumer(AsyncJsonWebsocketConsumer):
    async def connect(self) -> None:
        await self.close()


class TaskListConsumer(AsyncJsonWebsocketConsumer):
    async def connect(self) -> None:
        await self.close()
