"""Outside load tools driving a running stack: locust over gRPC, NVIDIA's AIPerf over the OpenAI API."""
